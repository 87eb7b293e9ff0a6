"""Who owns which parameter: gradient buckets on parameter boundaries, each given to one rank of a shard group.

Under ``HorizonStrategy(state="node_sharded")`` the state is sharded over a shard group of ``shard_group_nodes``
consecutive nodes (one node by default, up to about a quarter of the nodes on large clusters) and every shard group
holds the same copy. Every parameter has one owner per shard group, at the same place in each: that rank receives
the gradient of it, runs the optimizer on it and holds its optimizer state and master. On every node, the local rank
at the owner's local place sums the node's gradients of it (its reducer). Parameters are cut into buckets the way
DDP cuts them (reverse registration order, which is roughly the order backward produces gradients, at most
``cap_bytes`` each, one dtype per bucket, never splitting a parameter), and each bucket goes whole to one owner,
largest buckets first to the owner holding the fewest bytes so far: the owners' shares differ by at most one bucket.
The plan depends only on the parameter list, the cap and the number of owners, so every rank computes the same plan
without talking to the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import torch
from torch import Tensor


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients are reduced together, to one owner."""

    index: int
    owner: int  # the owner's place in its shard group: node in the group x ranks per node + local rank
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


@dataclass(frozen=True)
class Owners:
    """The places of a shard group, ``nodes x ranks_per_node`` ranks in a row, and this rank's among them.

    Shard groups are consecutive blocks of ranks, so a rank's place is its rank modulo the block."""

    ranks_per_node: int
    nodes: int  # per shard group
    rank: int  # this rank's, global

    @property
    def count(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def me(self) -> int:
        """This rank's place in its shard group."""
        return self.rank % self.count

    def reducer(self, owner: int) -> int:
        """The local rank that sums, on every node, the gradients of the buckets ``owner`` owns."""
        return owner % self.ranks_per_node

    def rank_of(self, owner: int) -> int:
        """The global rank of ``owner`` in this rank's shard group."""
        return self.rank - self.me + owner


#: ``shard_group_nodes="auto"``: shard groups of about this share of the nodes (the design's parameter server with
#: about nodes/4 shards past 16 nodes): the state per node falls as nodes are added, 4 copies of it stay
AUTO_SHARE = 4


def resolve_group_nodes(value: Union[str, int], num_nodes: int) -> int:
    """``shard_group_nodes`` on ``num_nodes`` nodes: an int as given (checked to divide them in the Trainer's
    constructor); ``"auto"``: the largest divisor of ``num_nodes`` up to ``num_nodes // AUTO_SHARE`` (1 below 8
    nodes: every node holds a copy, nothing crosses nodes but the gradients)."""
    if value != "auto":
        return int(value)
    return max(d for d in range(1, max(1, num_nodes // AUTO_SHARE) + 1) if num_nodes % d == 0)


def plan_buckets(params: list[Tensor], owners: int, cap_bytes: int) -> list[Bucket]:
    """The buckets of ``params`` (trainable parameters, registration order) and their owners (places ``0 ..
    owners - 1``), in launch order.

    The cap is ``cap_bytes``, lowered so that every owner gets about :data:`BUCKETS_PER_OWNER` buckets (not below
    :data:`MIN_BUCKET_BYTES`)."""
    if owners < 1 or cap_bytes < 1:
        raise ValueError(f"owners={owners!r}, cap_bytes={cap_bytes!r}: both must be >= 1")
    total = sum(p.numel() * p.element_size() for p in params)
    cap_bytes = min(cap_bytes, max(MIN_BUCKET_BYTES, total // (BUCKETS_PER_OWNER * owners)))
    buckets: list[Bucket] = []
    for p in reversed(params):
        last = buckets[-1] if buckets else None
        if last is None or last.dtype != p.dtype or last.nbytes + p.numel() * p.element_size() > cap_bytes:
            last = Bucket(index=len(buckets), owner=0, dtype=p.dtype)
            buckets.append(last)
        last.params.append(p)
    loads = [0] * owners
    for b in sorted(buckets, key=lambda b: (-b.nbytes, b.index)):
        b.owner = min(range(owners), key=lambda r: (loads[r], r))
        loads[b.owner] += b.nbytes
    return buckets


__all__ = ["AUTO_SHARE", "Bucket", "Owners", "plan_buckets", "resolve_group_nodes"]
