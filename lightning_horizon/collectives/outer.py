"""The outer step of local SGD across nodes (DiLoCo), with the cross-node exchange overlapped with the next period.

Under ``sync_every=H`` each node trains on its own for H optimizer steps (gradients reduced inside the node). At the
end of a period, plain local SGD averages the nodes' weights, and every rank waits for that average. DiLoCo
(Douillard et al., 2023) treats the period's change as a gradient instead: each node sends its *delta*, the
*anchor* (the weights every node agreed on at the last outer step) minus its weights now; the average delta is the
outer gradient, and an outer optimizer steps the anchor with it (``outer="nesterov"``: SGD with Nesterov momentum,
lr 0.7 and momentum 0.9 in the paper; ``outer="average"`` with ``sync_overlap=True``: the anchor minus the average
delta, which is the nodes' average). Every node then continues from the new anchor.

``sync_overlap=True`` hides the exchange behind compute, as streaming DiLoCo's overlapped variant does (Douillard et
al., 2025): the delta is sent without blocking and training goes on; one period later, at the next outer step, the
average has arrived (or the rank waits for what is left of it), the anchor takes its outer step, and the node's
weights become the new anchor plus what the node trained since it sent its delta. So every outer update is one
period late (bounded staleness, one exchange), and the delta sent next is again exactly one period of local
progress. The exchange runs on a process group of its own (gloo works it on its threads), so the intra-node
gradient reductions and any other collective of the step go on beside it.

``sync_overlap="auto"`` lets the strategy decide, once, at the first outer step: the cost model (the setup probe's
links, or ``cost_model=``) predicts the exchange's time, the first period measured its compute (the slowest rank's),
and the exchange is overlapped where hiding it is predicted to save at least :data:`OVERLAP_GAIN` of a period;
elsewhere a period of staleness buys too little. The decision is logged with its figures and checkpointed.

Memory: each local rank keeps its 1/L slice of the flattened true weights' anchor, Nesterov velocity and (with
overlap) the snapshot it sent from, and the delta in flight: at most 4/L of the weights per rank, one copy of each
per node. All ranks of a node hold bitwise-equal weights, so each updates its own slice and the node all-gathers
the slices into every rank's weights (the true weights, through ``TrainingState``: fp32 masters, bf16 +
compensation). Everything is in fp32, or float64 under ``precision="64-true"``. A checkpoint waits for an exchange
in flight and saves its sum with the slices, so a resume applies it at the same step as the run that went on.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_horizon.collectives.chunks import row_slice
from lightning_horizon.collectives.comm import Comm
from lightning_horizon.state import TrainingState

OUTERS = ("average", "nesterov")
#: ``sync_overlap="auto"`` overlaps where that is predicted to save at least this share of a period's time
OVERLAP_GAIN = 0.05


class OuterSync:
    """This rank's share of the outer optimizer: the anchor, velocity and snapshot slices, and the exchange."""

    def __init__(self, kind: str, lr: float, momentum: float, overlap: Union[bool, str], params: list[Tensor],
                 row: Comm, col: Comm, state: TrainingState, exchange_seconds: Optional[float] = None,
                 info: Callable[[str], None] = lambda message: None) -> None:
        """``row``: this node's ranks (the slices are gathered there); ``col``: this local rank on every node, a
        process group used for nothing else (the exchange is in flight beside the step's collectives).
        ``overlap="auto"``: decided at the first outer step from ``exchange_seconds``, the cost model's time for
        the exchange; ``info``: where the decision is told (rank 0's log)."""
        self.kind, self.lr, self.momentum, self.overlap = kind, lr, momentum, overlap
        self.exchange_seconds, self._info = exchange_seconds, info
        self._started = 0.0  # when local training began (the first period's compute is measured from there)
        self.params, self.row, self.col, self.state = params, row, col, state
        self.anchor: Optional[Tensor] = None
        self.velocity: Optional[Tensor] = None
        self.snapshot: Optional[Tensor] = None  # with overlap: this slice's weights when its delta was sent
        self._sent: Optional[Tensor] = None  # the delta in flight, then the nodes' sum of deltas
        self._work: Any = None
        #: seconds the last outer step waited for the exchange (with overlap: the part compute did not hide)
        self.waited = 0.0

    def _slices(self) -> tuple[Tensor, Tensor, int]:
        """The true weights, flat and padded to a multiple of the node's ranks, this rank's slice of them (a view),
        and their unpadded length."""
        flat = self.state.read_flat(self.params)
        return (*row_slice(flat, self.row.size, self.row.index), flat.numel())

    @torch.no_grad()
    def start(self) -> None:
        """Take the anchor: this rank's slice of the weights every node holds where local training begins."""
        self.anchor = self._slices()[1].clone()
        self._started = time.perf_counter()

    @torch.no_grad()
    def step(self) -> None:
        """The end of a period: the outer step, and (with overlap) the next exchange started."""
        if self.anchor is None:
            raise RuntimeError("OuterSync.step before start(): no anchor to step from")
        if self.overlap == "auto":
            self.overlap = self._decide()
        padded, mine, n = self._slices()
        moved = True
        if not self.overlap:
            delta = self.anchor - mine
            self.col.allreduce(delta)
            self._outer_step(delta.div_(self.col.size))
            mine.copy_(self.anchor)
        elif self._sent is None:  # the first exchange: nothing has arrived yet
            moved = False
        else:
            self._outer_step(self._arrived())
            mine.copy_(self.anchor + (mine - self.snapshot))  # and what this node trained since it sent
        if self.overlap:
            self.snapshot = mine.clone()
            self._sent = self.anchor - mine
            self._work = self.col.allreduce(self._sent, async_op=True)
        if moved:
            self.row.all_gather(padded, mine)
            self.state.write_flat(self.params, padded[:n])

    def _decide(self) -> bool:
        """``sync_overlap="auto"`` at the first outer step: overlap where hiding the predicted exchange saves at
        least OVERLAP_GAIN of a period. The period is the slowest rank's, so every rank decides alike."""
        period = torch.tensor([time.perf_counter() - self._started], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(period, op=dist.ReduceOp.MAX)
        compute, exchange = float(period), float(self.exchange_seconds or 0.0)
        saved = min(exchange, compute) / (compute + exchange) if compute + exchange > 0 else 0.0
        overlap = saved >= OVERLAP_GAIN
        self._info(f"collectives: sync_overlap='auto': the exchange is predicted to take {exchange * 1e3:.1f} ms"
                   f" against {compute * 1e3:.0f} ms of compute per period; overlapping it saves {saved:.0%} of a"
                   f" period: {'overlapped' if overlap else f'not overlapped (below {OVERLAP_GAIN:.0%})'}")
        return overlap

    def _arrived(self) -> Tensor:
        """The nodes' average delta of the exchange in flight, waited for."""
        start = time.perf_counter()
        self.drain()
        self.waited = time.perf_counter() - start
        assert self._sent is not None
        mean, self._sent = self._sent.div_(self.col.size), None
        return mean

    def _outer_step(self, mean_delta: Tensor) -> None:
        assert self.anchor is not None
        if self.kind == "average":
            self.anchor.sub_(mean_delta)
            return
        if self.velocity is None:
            self.velocity = torch.zeros_like(self.anchor)
        self.velocity.mul_(self.momentum).add_(mean_delta)  # torch.optim.SGD(nesterov=True), dampening 0
        self.anchor.sub_(mean_delta.add(self.velocity, alpha=self.momentum), alpha=self.lr)

    def drain(self) -> None:
        """Wait for the exchange in flight (it keeps its sum until the next outer step applies it)."""
        if self._work is not None:
            self._work.wait()
            self._work = None

    def state_dict(self) -> dict[str, Any]:
        self.drain()  # a checkpoint holds the exchange's result, never a half-sent delta
        return {"anchor": self.anchor, "velocity": self.velocity, "snapshot": self.snapshot, "sent": self._sent,
                "overlap": self.overlap}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drain()
        self.anchor, self.velocity = state["anchor"], state["velocity"]
        self.snapshot, self._sent = state["snapshot"], state["sent"]
        if self.overlap == "auto":  # decided before the checkpoint: the resumed run goes on as it did
            self.overlap = state.get("overlap", "auto")


__all__ = ["OUTERS", "OuterSync"]
