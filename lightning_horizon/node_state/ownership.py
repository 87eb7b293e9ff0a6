"""Who owns which parameter inside a node: gradient buckets on parameter boundaries, each given to one local rank.

Under ``HorizonStrategy(state="node_sharded")`` every parameter has one owner per node, the same local rank on every
node: that rank receives the node's gradient of it, runs the optimizer on it and holds its optimizer state and
master. Parameters are cut into buckets the way DDP cuts them (reverse registration order, which is roughly the
order backward produces gradients, at most ``cap_bytes`` each, one dtype per bucket, never splitting a parameter),
and each bucket goes whole to one local rank, largest buckets first to the rank holding the fewest bytes so far: the
owners' shares differ by at most one bucket. The plan depends only on the parameter list, the cap and the number of
local ranks, so every rank computes the same plan without talking to the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients are reduced together, to one owner."""

    index: int
    owner: int  # local rank
    dtype: torch.dtype
    params: list[Tensor] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def nbytes(self) -> int:
        return self.numel * self.params[0].element_size() if self.params else 0


#: at least this many buckets per owner where the parameters allow it: a bucket is the unit of ownership, and with
#: one or two per rank (a small model, 8 MiB buckets) one rank held half the node's state and another none
BUCKETS_PER_OWNER = 4
MIN_BUCKET_BYTES = 64 * 1024  # below this, a message's latency costs more than the balance gains


def plan_buckets(params: list[Tensor], ranks_per_node: int, cap_bytes: int) -> list[Bucket]:
    """The buckets of ``params`` (trainable parameters, registration order) and their owners, in launch order.

    The cap is ``cap_bytes``, lowered so that every owner gets about :data:`BUCKETS_PER_OWNER` buckets (not below
    :data:`MIN_BUCKET_BYTES`)."""
    if ranks_per_node < 1 or cap_bytes < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node!r}, cap_bytes={cap_bytes!r}: both must be >= 1")
    total = sum(p.numel() * p.element_size() for p in params)
    cap_bytes = min(cap_bytes, max(MIN_BUCKET_BYTES, total // (BUCKETS_PER_OWNER * ranks_per_node)))
    buckets: list[Bucket] = []
    for p in reversed(params):
        last = buckets[-1] if buckets else None
        if last is None or last.dtype != p.dtype or last.nbytes + p.numel() * p.element_size() > cap_bytes:
            last = Bucket(index=len(buckets), owner=0, dtype=p.dtype)
            buckets.append(last)
        last.params.append(p)
    loads = [0] * ranks_per_node
    for b in sorted(buckets, key=lambda b: (-b.nbytes, b.index)):
        b.owner = min(range(ranks_per_node), key=lambda r: (loads[r], r))
        loads[b.owner] += b.nbytes
    return buckets


def owned_parameters(buckets: list[Bucket], local_rank: int) -> list[Tensor]:
    return [p for b in buckets if b.owner == local_rank for p in b.params]


__all__ = ["Bucket", "owned_parameters", "plan_buckets"]
