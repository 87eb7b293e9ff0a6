"""The owners' updated weights sent to the ranks that hold copies of them, after each optimizer step.

Two users. ``node_weights="copies"`` (:class:`BroadcastParameters`): every rank keeps its own copy of the weights,
and after each step each bucket's reducer broadcasts its parameters inside the node. Against one shared copy
(shared_params.py, the default) it costs L copies of the weights per node and, per step, each rank receiving the
(L-1)/L of the weights it does not hold; it needs no shared-memory folder. And a shard group of several nodes
(``shard_group_nodes > 1``): each owner broadcasts its parameters to the reducers of its buckets on the other nodes
of the group, before the node's own sharing (a barrier, or the broadcast above). Every shard group's owner of a
parameter computed the same update from the same reduced gradient and state, so nothing crosses shard groups.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_horizon.node_state.ownership import Bucket, Owners
from lightning_horizon.topology import Topology


class ParameterBroadcast:
    """Parameters broadcast from their sources inside one process group: one flat message per source and dtype."""

    def __init__(self, sources: dict[tuple[int, torch.dtype], list[Tensor]], group: Optional[dist.ProcessGroup],
                 rank: int, receivers: int) -> None:
        """``sources``: (global rank of the sender, dtype) -> its parameters, the same on every rank of ``group``;
        ``receivers``: the ranks of the group besides the sender."""
        self._sources = sorted(sources.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))  # the same order everywhere
        self._group, self._rank, self._receivers = group, rank, receivers
        self._flat: dict[tuple[int, torch.dtype], Tensor] = {}
        self.bytes_sent = 0.0  # by this rank in the last step
        self.seconds = 0.0  # in its broadcasts
        self.calls = 0

    @torch.no_grad()
    def send(self) -> None:
        self.bytes_sent = self.seconds = 0.0
        self.calls = 0
        if self._receivers == 0:  # a group of one rank (one rank per node): nobody to send to
            return
        for (src, dtype), params in self._sources:
            flat = self._flat.get((src, dtype))
            if flat is None:
                flat = self._flat[(src, dtype)] = torch.empty(sum(p.numel() for p in params), dtype=dtype)
            if src == self._rank:
                torch.cat([p.detach().reshape(-1) for p in params], out=flat)
                self.bytes_sent += self._receivers * flat.numel() * flat.element_size()
            start = time.perf_counter()
            dist.broadcast(flat, src=src, group=self._group)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            if src != self._rank:
                off = 0
                for p in params:
                    p.copy_(flat[off : off + p.numel()].view(p.shape))
                    off += p.numel()

    def clear(self) -> None:
        self._flat.clear()


def group_broadcast(buckets: list[Bucket], owners: Owners, peers: Optional[dist.ProcessGroup]) -> ParameterBroadcast:
    """Each owner's parameters to the reducers of its buckets on the other nodes of its shard group (``peers``: this
    local rank on those nodes)."""
    local = owners.rank % owners.ranks_per_node
    sources: dict[tuple[int, torch.dtype], list[Tensor]] = {}
    for b in buckets:
        if owners.reducer(b.owner) == local:
            sources.setdefault((owners.rank_of(b.owner), b.dtype), []).extend(b.params)
    return ParameterBroadcast(sources, peers, owners.rank, owners.nodes - 1)


class BroadcastParameters:
    """``node_weights="copies"``: every bucket's parameters broadcast inside the node by its reducer after each
    step (the owner, or where the shard group spans nodes, the rank that received them from the owner)."""

    def __init__(self, module: nn.Module, buckets: list[Bucket], intra: Optional[dist.ProcessGroup],
                 topology: Topology, owners: Owners) -> None:
        self.params = list(dict.fromkeys(module.parameters()))
        base = topology.node_rank * topology.ranks_per_node
        sources: dict[tuple[int, torch.dtype], list[Tensor]] = {}
        for b in buckets:
            sources.setdefault((base + owners.reducer(b.owner), b.dtype), []).extend(b.params)
        self._broadcast = ParameterBroadcast(sources, intra, topology.rank, topology.ranks_per_node - 1)

    @property
    def bytes_sent(self) -> float:
        return self._broadcast.bytes_sent

    @property
    def seconds(self) -> float:
        return self._broadcast.seconds

    @property
    def calls(self) -> int:
        return self._broadcast.calls

    def install(self, token: str) -> None:
        with torch.no_grad():
            for p in self.params:  # every node starts from global rank 0's weights
                dist.broadcast(p.data, src=0)

    def after_step(self) -> None:
        self._broadcast.send()

    def uninstall(self) -> None:
        self._broadcast.clear()


__all__ = ["BroadcastParameters", "ParameterBroadcast", "group_broadcast"]
