"""One process group, seen from this rank: the collectives our algorithms use, each accounted.

The algorithms issue these one after another from the thread DDP calls the hook on, so every rank issues the
same collectives in the same order; a call with ``async_op=True`` returns the pending works, which the same
thread waits for later (a pipeline overlaps one group's collective with another's). Nothing is ever issued from a
``Future.then`` callback: on gloo those run on worker threads, came out of order, and gave silently wrong
gradients (docs/collectives.md). Bytes are accounted when a collective is issued; the hook times the whole
reduction, since overlapped collectives have no time of their own.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_horizon.collectives.accounting import CommAccounting
from lightning_horizon.topology import Topology


class Pending:
    """Works issued together, waited for together (by the thread that issued them)."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


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
        # Pairwise exchanges post to every peer at once, starting with the next one, so that the ranks of a
        # group do not all send to the same peer first.
        self._peers = [(self.index + i) % self.size for i in range(1, self.size)]
        self._received = torch.empty(0)

    # ------------------------------------------------------------------ accounting

    def _ring(self, nbytes: float) -> None:
        """``nbytes`` sent to the ring neighbour."""
        self.accounting.record(0.0 if self._right_crosses else nbytes, nbytes if self._right_crosses else 0.0)

    def _pairwise(self, block_bytes: float) -> None:
        """``block_bytes`` sent to each other member."""
        inter = block_bytes * self._crossing_peers
        self.accounting.record(block_bytes * (self.size - 1) - inter, inter)

    # ------------------------------------------------------------------ collectives

    def allreduce(self, tensor: torch.Tensor, async_op: bool = False) -> Optional[dist.Work]:
        """Sum ``tensor`` in place over the group (gloo: ring, 2(g-1)/g of it sent to the neighbour)."""
        if self.size == 1:
            return None
        self._ring(2 * (self.size - 1) / self.size * _nbytes(tensor))
        return dist.all_reduce(tensor, group=self.group, async_op=async_op)

    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> Optional[Pending]:
        """Row ``j`` of ``tensor`` (``[g, m]``) goes to member ``j``; row ``j`` of ``out`` comes from member ``j``.

        Paired isend/irecv rather than gloo's all_to_all_single, which moved the same bytes 3-6x slower here.
        """
        out[self.index].copy_(tensor[self.index])
        if self.size == 1:
            return None
        self._pairwise(_nbytes(tensor) / self.size)
        return self._exchange([(tensor[j], out[j], j) for j in self._peers], async_op)

    def _exchange(self, pairs: list, async_op: bool) -> Optional[Pending]:
        works = []
        for send, recv, j in pairs:
            works.append(dist.irecv(recv, src=self.ranks[j], group=self.group))  # global ranks: torch >= 2.6 too
            works.append(dist.isend(send, dst=self.ranks[j], group=self.group))
        pending = Pending(works)
        if async_op:
            return pending
        pending.wait()
        return None

    def reduce_scatter_start(self, tensor: torch.Tensor) -> tuple[Optional[Pending], torch.Tensor]:
        """Start a reduce-scatter of ``tensor`` (length divisible by g); :meth:`reduce_scatter_finish` sums.

        An all-to-all and a local fp32 sum in member order: (g-1)/g of the tensor on the wire, where gloo's own
        reduce_scatter runs a full allreduce (twice the bytes) and keeps one chunk. A bf16 tensor goes on the wire
        in bf16 and is still summed in fp32.
        """
        # One reduce-scatter runs at a time on a Comm (the pipeline finishes one before starting the next), so
        # one receive buffer serves them all: no bucket-sized allocation per call.
        if self._received.numel() < tensor.numel() or self._received.dtype != tensor.dtype:
            self._received = torch.empty(tensor.numel(), dtype=tensor.dtype)
        received = self._received[: tensor.numel()].view(self.size, -1)
        return self.all_to_all(received, tensor.view(self.size, -1), async_op=True), received

    @staticmethod
    def reduce_scatter_finish(started: tuple[Optional[Pending], torch.Tensor]) -> torch.Tensor:
        """This member's 1/g slice of the group's sum, in fp32 or wider (a bf16 wire is summed in fp32, a float64
        one in float64)."""
        work, received = started
        if work is not None:
            work.wait()
        return received.sum(dim=0, dtype=torch.promote_types(received.dtype, torch.float32))

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> Optional[Pending]:
        """Concatenate every member's ``tensor`` into ``out`` in member order: ``tensor`` goes to every member.

        Paired isend/irecv again: gloo's all_gather moved the same bytes 3-10x slower here.
        """
        rows = out.view(self.size, -1)
        rows[self.index].copy_(tensor.reshape(-1))  # in ``out``'s dtype: an fp32 sum is sent as bf16 into bf16
        if self.size == 1:
            return None
        self._pairwise(_nbytes(rows[self.index]))
        return self._exchange([(rows[self.index], rows[j], j) for j in self._peers], async_op)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
