"""The other way for a node's ranks to see the owners' updates (``node_weights="copies"``): every rank keeps its own
copy of the weights, and after each optimizer step each owner broadcasts its parameters inside the node.

Against one shared copy (shared_params.py, the default) it costs L copies of the weights per node and, per step,
each rank receiving the (L-1)/L of the weights it does not own; it needs no shared-memory folder. Every node's owner
of a parameter computed the same update from the same reduced gradient and state, so nothing crosses nodes; at
setup every rank takes global rank 0's weights, as DDP does at construction.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_horizon.node_state.ownership import Bucket
from lightning_horizon.topology import Topology


class BroadcastParameters:
    """Each owner's parameters, one flat message per owner and dtype, broadcast inside the node after each step."""

    def __init__(self, module: nn.Module, buckets: list[Bucket], intra: Optional[dist.ProcessGroup],
                 topology: Topology) -> None:
        self.params = list(dict.fromkeys(module.parameters()))
        self._intra, self.topology = intra, topology
        groups: dict[tuple[int, torch.dtype], list[Tensor]] = {}
        for b in buckets:
            groups.setdefault((b.owner, b.dtype), []).extend(b.params)
        self._groups = sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))  # the same order everywhere
        self._flat: dict[tuple[int, torch.dtype], Tensor] = {}
        self.bytes_sent = 0.0  # by this rank in the last step

    def install(self, token: str) -> None:
        with torch.no_grad():
            for p in self.params:  # every node starts from global rank 0's weights
                dist.broadcast(p.data, src=0)

    def after_step(self) -> None:
        me, base, size = self.topology.local_rank, self.topology.node_rank * self.topology.ranks_per_node, \
            self.topology.ranks_per_node
        self.bytes_sent = 0.0
        with torch.no_grad():
            for (owner, dtype), params in self._groups:
                flat = self._flat.get((owner, dtype))
                if flat is None:
                    flat = self._flat[(owner, dtype)] = torch.empty(sum(p.numel() for p in params), dtype=dtype)
                if owner == me:
                    torch.cat([p.detach().reshape(-1) for p in params], out=flat)
                    self.bytes_sent += (size - 1) * flat.numel() * flat.element_size()
                dist.broadcast(flat, src=base + owner, group=self._intra)
                if owner != me:
                    off = 0
                    for p in params:
                        p.copy_(flat[off : off + p.numel()].view(p.shape))
                        off += p.numel()

    def uninstall(self) -> None:
        self._flat.clear()


__all__ = ["BroadcastParameters"]
