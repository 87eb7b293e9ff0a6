"""One copy of the parameters per node: the module's parameters become views into a shared-memory file.

Every local rank maps the same file, so a node holds its parameters once instead of once per rank, and an owner's
optimizer step writes its parameters in place where every rank of the node reads them: sharing the updated weights
back costs one barrier, not an all-gather. The file lives in ``/dev/shm`` (memory, not disk) and is unlinked as soon
as every rank has mapped it, so nothing is left behind by a crash; the mapping itself lives as long as the tensors.

Local rank 0 creates the file and copies its parameters in; across nodes, global rank 0's values are broadcast
between the local ranks 0 (what DDP does at construction), so every node starts from the same weights. Writes happen
only in the optimizer step, by the owner of each parameter (node_state/ownership.py), and every rank waits at a node
barrier after each step (``NodeState.optimizer_stepped``) before anything reads them again.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_horizon.memory.probe import fmt_bytes
from lightning_horizon.state import TrainingState

SHM_DIR = "/dev/shm"
_ALIGN = 64  # bytes: every parameter starts on a cache line (and on its dtype's alignment)


class SharedParameters:
    """The parameters of ``module`` moved into one shared file per node (:meth:`install`), and back out
    (:meth:`uninstall`)."""

    def __init__(self, module: nn.Module, intra: Optional[dist.ProcessGroup], inter: Optional[dist.ProcessGroup],
                 local_rank: int, node_rank: int, training_state: TrainingState) -> None:
        self.params = list(dict.fromkeys(module.parameters()))  # tied parameters once
        self._state = training_state  # through which the parameters' storage moves in and out
        self._intra, self._inter = intra, inter
        self.local_rank, self.node_rank = local_rank, node_rank
        offsets, end = [], 0
        for p in self.params:
            end = -(-end // _ALIGN) * _ALIGN
            offsets.append(end)
            end += p.numel() * p.element_size()
        self._offsets, self.nbytes = offsets, end
        self._raw: Optional[Tensor] = None

    def install(self, token: str) -> None:
        """Map the node's file (collective over the node, then between the nodes' local ranks 0)."""
        path = os.path.join(SHM_DIR, f"lightning-horizon-{token}-node{self.node_rank}")
        check_room(self.nbytes)  # on every rank (one machine, one answer): none is left waiting in a barrier
        if self.local_rank == 0:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, max(self.nbytes, 1))
            finally:
                os.close(fd)
        self._barrier()  # the file exists
        try:
            raw = torch.from_file(path, shared=True, size=max(self.nbytes, 1), dtype=torch.uint8)
        finally:
            self._barrier()  # every rank has mapped it (or failed): nothing to clean up after a crash
            if self.local_rank == 0:
                os.unlink(path)
        views = [self._view(raw, p, off) for p, off in zip(self.params, self._offsets)]
        with torch.no_grad():
            if self.local_rank == 0:
                for p, v in zip(self.params, views):
                    v.copy_(p.detach())
                if self._inter is not None:  # every node starts from global rank 0's weights, as under DDP
                    dist.broadcast(raw, src=0, group=self._inter)
        self._barrier()  # the weights are in place before any rank reads them
        for p, v in zip(self.params, views):
            self._state.rebind(p, v)  # same Parameter objects: optimizers, hooks and state_dict keys are untouched
        self._raw = raw

    def after_step(self) -> None:
        """Every owner has written its parameters before any rank of the node reads them again."""
        self._barrier()

    def uninstall(self) -> None:
        """Give every parameter its own memory again (the module leaves the fit as it came in)."""
        if self._raw is None:
            return
        # no barrier: every optimizer step ended with one (after a failure, a peer may be gone)
        self._state.own_memory(self.params)
        self._raw = None

    @staticmethod
    def _view(raw: Tensor, p: Tensor, offset: int) -> Tensor:
        nbytes = p.numel() * p.element_size()
        return raw[offset : offset + nbytes].view(p.dtype).view(p.shape)

    def _barrier(self) -> None:
        if self._intra is not None:
            dist.barrier(group=self._intra)


def check_room(nbytes: int) -> None:
    """Fail before anything is written when the shared-memory folder cannot take one copy of the parameters (a
    container's default ``/dev/shm`` is 64 MiB)."""
    if not os.path.isdir(SHM_DIR):
        raise RuntimeError(
            f"HorizonStrategy(state='node_sharded') keeps one copy of the parameters per node in {SHM_DIR}, which this"
            " machine does not have; pass node_weights='copies' (a copy per rank, updated by broadcast)"
        )
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise RuntimeError(
            f"HorizonStrategy(state='node_sharded') keeps one copy of the parameters per node in {SHM_DIR}: it needs"
            f" {fmt_bytes(nbytes)} but {fmt_bytes(free)} is free there (containers default to 64 MiB: run with"
            " `--shm-size`, or pass node_weights='copies': a copy per rank, updated by broadcast)"
        )


__all__ = ["SHM_DIR", "SharedParameters", "check_room"]
