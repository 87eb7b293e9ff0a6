"""Per-step communication accounting: bytes this rank sent per link class, and time spent communicating.

The byte counts follow the algorithm each call runs (gloo's ring allreduce: 2(g-1)/g of the tensor to the ring
neighbour; all-to-all as paired isend/irecv: 1/g of the input to each peer; all-gather likewise: the input to
each peer), each transfer classified by whether its peer is on this rank's node. They are what the application asks the wire to carry,
without TCP/IP headers; recipes/bench_collectives.py checks them against the interface counters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Counters:
    """Bytes sent by this rank over intra-node and inter-node links, seconds in collectives, collective calls."""

    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    seconds: float = 0.0
    calls: int = 0

    def add(self, other: "Counters") -> None:
        self.intra_bytes += other.intra_bytes
        self.inter_bytes += other.inter_bytes
        self.seconds += other.seconds
        self.calls += other.calls


class CommAccounting:
    """Collects :class:`Counters` per optimizer step; ``last_step`` holds the step that just ended."""

    def __init__(self) -> None:
        self.current = Counters()
        self.last_step = Counters()
        self.total = Counters()
        self.steps = 0

    def record(self, intra_bytes: float, inter_bytes: float) -> None:
        """One collective issued by this rank."""
        c = self.current
        c.intra_bytes += intra_bytes
        c.inter_bytes += inter_bytes
        c.calls += 1

    def add_seconds(self, seconds: float) -> None:
        """Wall time of one reduction (a hook call, a parameter average), from its start to its completion."""
        self.current.seconds += seconds

    def end_step(self) -> Counters:
        """Close the step: what it sent moves to ``last_step`` and into ``total``."""
        self.last_step, self.current = self.current, Counters()
        self.total.add(self.last_step)
        self.steps += 1
        return self.last_step

    def metrics(self, prefix: str = "comm/") -> dict[str, float]:
        """The last step's figures, named for ``LightningModule.log`` / a monitor callback."""
        last = asdict(self.last_step)
        return {f"{prefix}{k}": float(v) for k, v in last.items()}
