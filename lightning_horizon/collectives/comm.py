"""One process group, seen from this rank: the collectives our algorithms use, each timed and accounted.

Every call here blocks until the collective has finished (except :meth:`Comm.allreduce_async`, whose only
continuation is a division). The algorithms call them one after another from the thread DDP calls the hook on,
so every rank issues the same collectives in the same order: on gloo, collectives issued from ``Future.then``
callbacks ran on worker threads, out of order, and gave silently wrong gradients (docs/collectives.md).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from lightning_horizon.collectives.accounting import CommAccounting
from lightning_horizon.topology import Topology

# torch >= 2.10 names the single-tensor collectives *_single and deprecates the *_tensor names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Comm:
    """A process group of ``ranks`` (global ranks in group order) that contains this rank."""

    def __init__(
        self, group: Optional[dist.ProcessGroup], ranks: list[int], topology: Topology, accounting: CommAccounting
    ) -> None:
        self.group, self.ranks, self.size = group, list(ranks), len(ranks)
        self.index = self.ranks.index(topology.rank)
        self.accounting = accounting
        node = topology.node_rank
        per_node = topology.ranks_per_node
        self._right_crosses = self.ranks[(self.index + 1) % self.size] // per_node != node
        peers = [r for r in self.ranks if r != topology.rank]
        self._crossing_peers = sum(r // per_node != node for r in peers)

    # ------------------------------------------------------------------ accounting

    def _ring(self, nbytes: float, seconds: float) -> None:
        """``nbytes`` sent to the ring neighbour."""
        self.accounting.record(0.0 if self._right_crosses else nbytes, nbytes if self._right_crosses else 0.0, seconds)

    def _pairwise(self, block_bytes: float, seconds: float) -> None:
        """``block_bytes`` sent to each other member."""
        inter = block_bytes * self._crossing_peers
        self.accounting.record(block_bytes * (self.size - 1) - inter, inter, seconds)

    # ------------------------------------------------------------------ collectives

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over the group (gloo: ring, 2(g-1)/g of it sent to the neighbour)."""
        if self.size > 1:
            start = time.perf_counter()
            dist.all_reduce(tensor, group=self.group)
            self._ring(2 * (self.size - 1) / self.size * _nbytes(tensor), time.perf_counter() - start)
        return tensor

    def allreduce_async(self, tensor: torch.Tensor) -> tuple[dist.Work, float]:
        """Start a sum in place; returns the work and its start time (the caller accounts the seconds)."""
        start = time.perf_counter()
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        self._ring(2 * (self.size - 1) / self.size * _nbytes(tensor), 0.0)
        return work, start

    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """Block ``j`` of ``tensor`` (split on dim 0) goes to member ``j``; ``out`` receives one block per member."""
        if self.size == 1:
            return out.copy_(tensor)
        start = time.perf_counter()
        dist.all_to_all_single(out, tensor, group=self.group)
        self._pairwise(_nbytes(tensor) / self.size, time.perf_counter() - start)
        return out

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        """This member's 1/g slice of the group's sum of ``tensor`` (length divisible by g).

        An all-to-all and a local fp32 sum in member order: (g-1)/g of the tensor on the wire, where gloo's own
        reduce_scatter runs a full allreduce (twice the bytes) and keeps one chunk.
        """
        if self.size == 1:
            return tensor.clone()
        received = torch.empty_like(tensor).view(self.size, -1)
        self.all_to_all(received, tensor.view(self.size, -1))
        return received.sum(dim=0)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every member's ``tensor`` into ``out`` in member order (gloo: ring)."""
        if self.size == 1:
            return out.copy_(tensor.view_as(out))
        start = time.perf_counter()
        _all_gather(out, tensor, group=self.group)
        self._ring((self.size - 1) / self.size * _nbytes(out), time.perf_counter() - start)
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
