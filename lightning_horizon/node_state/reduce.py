"""The gradient path of ``state="node_sharded"``: each bucket is summed on its node's reducer, then to its owner.

During backward, a hook on each parameter counts the gradients of its bucket; when a bucket is complete it is
launched, in bucket order on every rank (a bucket waits for the ones before it, as in DDP, so every rank issues the
same messages in the same order whatever order its gradients came in):

- every other local rank sends its flat copy of the bucket to the bucket's reducer, the local rank at the owner's
  local place (point to point inside the node), and drops its gradients: a rank keeps the gradients of the
  parameters it owns only;
- the reducer sums the node's copies in fp32 (bf16 gradients travel in bf16 and are summed in fp32);
- where the shard group spans several nodes, the reducers of the bucket on the group's nodes reduce their sums to
  the owner (``ShardGroup.peers``); the others keep nothing;
- the owner all-reduces the sum with the owners of the same bucket in the other shard groups (``ShardGroup.across``:
  with one node per shard group, the same local rank on every other node), divides by the world size and writes the
  result as the gradients of its parameters.

At most ``DEPTH`` buckets are in flight, so backward's compute overlaps the messages; their send and receive buffers
are ``DEPTH + 1`` slots allocated once and reused (a fresh bucket-sized buffer per bucket costs its page faults
every time: with glibc, large blocks are mapped on allocation and returned on free).
Buckets that are not complete when backward ends (parameters that got no gradient on this rank) go out at
:meth:`OwnerReduce.post_backward`, with zeros and a flag per parameter: a parameter that got a gradient on no rank
keeps ``grad=None``, as under DDP. Everything is issued from the thread that runs backward, never from a callback.

A backward that is not synchronized (gradient accumulation's micro-batches) leaves every rank's gradients local and
whole, as ``DDP.no_sync`` does; the synchronized backward that ends the window reduces the accumulated sum. A second
synchronized backward before the step (manual optimization) adds its reduced gradients to the first one's.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_horizon.node_state.ownership import Bucket, Owners
from lightning_horizon.topology import ShardGroup, Topology

DEPTH = 2  # buckets in flight


class OwnerReduce:
    """Reduce every bucket's gradients to its owner, for the ranks of one node and their peers on other nodes."""

    def __init__(self, buckets: list[Bucket], topology: Topology, owners: Owners, shard_group: ShardGroup) -> None:
        self.buckets = buckets
        self.topology = topology
        self._owners = owners
        self._peers = shard_group.peers  # this local rank on the other nodes of the shard group: None on one
        self._across = shard_group.across  # this place in the other shard groups: None with one shard group
        self._across_size = len(shard_group.across_ranks)
        self._base = topology.node_rank * topology.ranks_per_node
        self._bucket_of = {p: b for b in buckets for p in b.params}
        self._ready = [0] * len(buckets)
        self._next = 0
        self._armed = False
        self._inflight: deque = deque()
        # owned parameter -> the reduced gradient this wrote (weakly: after zero_grad it must not stay alive here)
        self._reduced: dict[Tensor, weakref.ref] = {}
        self._carry: dict[Tensor, Tensor] = {}  # owned parameter -> a reduced gradient set aside for a backward
        self.bytes_intra = 0.0  # sent by this rank in the last synchronized backward
        self.bytes_inter = 0.0
        self.seconds = 0.0  # waited for its sends, receives and reductions in it
        self.calls = 0  # point-to-point messages and collectives it issued
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._bucket_of]
        self._slots: dict[tuple[int, torch.dtype], tuple[Tensor, Tensor]] = {}  # (slot, dtype) -> (send, receive)
        self._launched = 0

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ backward

    def pre_backward(self, sync: bool) -> None:
        # A reduced gradient still on its parameter must not be reduced again: set it aside, add it back after.
        for p, ref in self._reduced.items():
            g = ref()
            if g is not None and p.grad is g:
                self._carry[p] = g
                p.grad = None
        self._reduced.clear()
        self._armed = sync
        self._ready = [0] * len(self.buckets)
        self._next = 0
        if sync:
            self.bytes_intra = self.bytes_inter = self.seconds = 0.0
            self.calls = 0

    def _on_grad(self, p: Tensor) -> None:
        if not self._armed:
            return
        b = self._bucket_of[p]
        self._ready[b.index] += 1
        if self._ready[b.index] > len(b.params):
            raise RuntimeError(
                "HorizonStrategy(state='node_sharded'): a gradient arrived twice in one backward (reentrant activation"
                " checkpointing, or backward through a part of the graph twice). Use torch.utils.checkpoint with"
                " use_reentrant=False, or state='replicated'"
            )
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def post_backward(self) -> None:
        if not self._armed:
            return
        self._armed = False
        while self._next < len(self.buckets):  # parameters without a gradient on this rank
            self._launch(self.buckets[self._next])
            self._next += 1
        while self._inflight:
            self._finish(*self._inflight.popleft())
        self._add_back(reduced=True)

    def settle(self) -> None:
        """Before an optimizer step: a reduced gradient set aside by a backward that was never synchronized goes back
        (plus that backward's local gradient, which DDP would hold too)."""
        self._add_back(reduced=False)

    def _add_back(self, reduced: bool) -> None:
        """The gradients set aside, plus what backward left on their parameters; ``reduced``: that is a reduced sum
        too, not to be reduced again."""
        for p, carried in self._carry.items():
            if p.grad is not None:
                carried.add_(p.grad)
            p.grad = carried
            if reduced:
                self._reduced[p] = weakref.ref(carried)
        self._carry.clear()

    # ------------------------------------------------------------------ one bucket

    def _buffers(self, b: Bucket) -> tuple[Tensor, Tensor]:
        """This launch's slot: a flat buffer for the bucket and flags, and room for the other ranks' copies."""
        key = (self._launched % (DEPTH + 1), b.dtype)
        self._launched += 1
        numel = b.numel + len(b.params)
        send, receive = self._slots.get(key, (torch.empty(0), torch.empty(0)))
        if send.numel() < numel:
            largest = max(x.numel + len(x.params) for x in self.buckets if x.dtype == b.dtype)
            send = torch.empty(largest, dtype=b.dtype)
            receive = torch.empty(self.topology.ranks_per_node - 1, largest, dtype=b.dtype)
            self._slots[key] = (send, receive)
        return send[:numel], receive[:, :numel]

    def _launch(self, b: Bucket) -> None:
        n = b.numel
        flat, received = self._buffers(b)
        off = 0
        for i, p in enumerate(b.params):
            k = p.numel()
            if p.grad is None:
                flat[off : off + k].zero_()
            else:
                flat[off : off + k].copy_(p.grad.reshape(-1))
            flat[n + i] = 0.0 if p.grad is None else 1.0
            p.grad = None  # the flat copy holds it now; the owner gets the sum back
            off += k
        me, size, reducer = self.topology.local_rank, self.topology.ranks_per_node, self._owners.reducer(b.owner)
        start = time.perf_counter()
        if reducer != me:
            work = dist.isend(flat, dst=self._base + reducer)
            self.bytes_intra += flat.numel() * flat.element_size()
            self._inflight.append((b, flat, [work], None))
            self.calls += 1
        else:
            peers = [j for j in range(size) if j != me]
            works = [dist.irecv(received[i], src=self._base + j) for i, j in enumerate(peers)]
            self._inflight.append((b, flat, works, received))
            self.calls += len(works)
        self.seconds += time.perf_counter() - start
        while len(self._inflight) > DEPTH:
            self._finish(*self._inflight.popleft())

    def _finish(self, b: Bucket, flat: Tensor, works: list, received: Optional[Tensor]) -> None:
        start = time.perf_counter()
        for w in works:
            w.wait()
        self.seconds += time.perf_counter() - start
        if received is None:
            return  # sent: this rank keeps nothing of the bucket
        wide = torch.promote_types(flat.dtype, torch.float32)
        total = torch.empty(flat.numel(), dtype=wide)  # new: the owner's gradients are views of it
        total.copy_(flat)
        for row in received:  # a fixed order (local ranks ascending, this rank first): the same sum every run
            total.add_(row)  # a bf16 row is added in fp32, without a widened copy
        start = time.perf_counter()
        if self._peers is not None:  # the shard group spans nodes: the owner takes the group's sum
            owner = self._owners.rank_of(b.owner)
            dist.reduce(total, dst=owner, group=self._peers)
            self.calls += 1
            if owner != self.topology.rank:
                self.bytes_inter += total.numel() * total.element_size()
                self.seconds += time.perf_counter() - start
                return
        if self._across is not None:
            dist.all_reduce(total, group=self._across)
            g = self._across_size
            self.bytes_inter += 2 * (g - 1) / g * total.numel() * total.element_size()
            self.calls += 1
        self.seconds += time.perf_counter() - start
        n = b.numel
        total[:n].div_(self.topology.world_size)
        got = (total[n:] > 0).tolist()  # the flags, read once (not one tensor-to-bool per parameter)
        off = 0
        for i, p in enumerate(b.params):
            k = p.numel()
            if got[i]:
                g = total[off : off + k].view(p.shape)
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
                self._reduced[p] = weakref.ref(p.grad)
            off += k


__all__ = ["DEPTH", "OwnerReduce"]
