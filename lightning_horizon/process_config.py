"""``HorizonStrategy``'s process options: how many ranks make a node, the backend, cores and threads, memory kept
between steps, how long a rank waits for a peer. Each field is the strategy's keyword of the same name, checked here
when the strategy is built (the Trainer's constructor), before a launcher starts a process or a group."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from lightning_horizon import heartbeat
from lightning_horizon.checks import is_int, is_number, require
from lightning_horizon.topology import check_ranks_per_node

OWNER = "HorizonStrategy"
BACKENDS = ("gloo", "ccl", "mpi", "nccl")
#: Collective timeout: long enough for a slow checkpoint write on rank 0 while the others wait in a barrier,
#: short enough that a lost peer ends the job instead of hanging it for torch's default 30 minutes.
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ProcessConfig:
    """The ranks, their cores and their links to each other (see docs/strategy.md)."""

    ranks_per_node: Optional[int] = None
    """Ranks per (emulated) node, dividing the world size; ``None``: the launcher's local world size."""

    bucket_size_mb: float = 8
    """DDP gradient bucket size in MiB (the unit each comm hook call reduces)."""

    timeout: Union[float, timedelta] = DEFAULT_TIMEOUT_S
    """Collective timeout in seconds (or a ``timedelta``, kept as one): a rank that waits longer for a peer fails."""

    process_group_backend: Optional[str] = None
    """``"gloo"``, ``"ccl"``, ``"mpi"``, ``"nccl"``; ``None``: ``ccl`` if oneCCL's binding imports, else gloo."""

    pin_cores: bool = True
    """Pin each local rank to its own slice of cores and size its thread pool to it."""

    threads_per_rank: Optional[int] = None
    """Intra-op threads per rank; ``None``: one per pinned core."""

    keep_freed_memory: bool = True
    """glibc's malloc keeps the memory a step frees for the next step instead of handing it back and faulting it in
    again (not under ``sharding``, whose budget measures RSS; not where malloc is jemalloc, tcmalloc or configured by
    you); given back at teardown."""

    heartbeat_timeout: Optional[float] = heartbeat.DEFAULT_TIMEOUT_S
    """Seconds after which a peer that sends no heartbeat, or makes no progress while the others wait for it, is
    named and the job ends (exit 75); ``None``: no heartbeat."""

    def __post_init__(self) -> None:
        check_ranks_per_node(self.ranks_per_node)
        require(is_number(self.bucket_size_mb, 0), OWNER, "bucket_size_mb", self.bucket_size_mb,
                "a finite number > 0 (MiB per DDP bucket)")
        seconds = self.timeout.total_seconds() if isinstance(self.timeout, timedelta) else self.timeout
        require(is_number(seconds, 0), OWNER, "timeout", self.timeout,
                "a finite number of seconds > 0, or a timedelta")
        object.__setattr__(self, "timeout", timedelta(seconds=float(seconds)))
        require(isinstance(self.pin_cores, bool), OWNER, "pin_cores", self.pin_cores, "True or False")
        require(isinstance(self.keep_freed_memory, bool), OWNER, "keep_freed_memory", self.keep_freed_memory,
                "True or False")
        check_backend(self.process_group_backend)
        require(self.threads_per_rank is None or is_int(self.threads_per_rank, 1), OWNER, "threads_per_rank",
                self.threads_per_rank, "an int >= 1 or None (one per core)")
        require(self.heartbeat_timeout is None or is_number(self.heartbeat_timeout, 0), OWNER, "heartbeat_timeout",
                self.heartbeat_timeout, "a finite number of seconds > 0, or None (no heartbeat)")
        if self.heartbeat_timeout is not None:
            object.__setattr__(self, "heartbeat_timeout", float(self.heartbeat_timeout))

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_size_mb * 2**20)

    def check_world(self, world: int, device: torch.device) -> None:
        """What the world decides, before the launcher starts a process: ``ranks_per_node`` divides the world size
        and the backend reduces ``device``'s tensors."""
        check_ranks_per_node(self.ranks_per_node, world)
        check_backend_device(self.process_group_backend, device)


def ccl_available() -> bool:
    """True when oneCCL's torch binding imports (importing it registers the ``ccl`` backend)."""
    try:
        importlib.import_module("oneccl_bindings_for_pytorch")
        return True
    except Exception:  # ImportError, or a binding built for another torch
        return False


def check_backend(backend: Any) -> None:
    """``process_group_backend`` is one of :data:`BACKENDS` (or None) and one this torch can start: else every
    process would fail in ``init_process_group`` (torch's "Unknown backend type ccl")."""
    require(backend is None or backend in BACKENDS, OWNER, "process_group_backend", backend,
            f"one of {BACKENDS} or None (auto)")
    missing = {
        "ccl": (ccl_available, "oneccl_bindings_for_pytorch is not installed (importing it registers 'ccl')"),
        "mpi": (dist.is_mpi_available, "torch is not built with MPI (torch.distributed.is_mpi_available() is False)"),
        "nccl": (dist.is_nccl_available, "torch is not built with NCCL (a CUDA build; NCCL reduces GPU tensors)"),
    }.get(backend)
    if missing is not None and not missing[0]():
        raise ValueError(f"{OWNER}(process_group_backend={backend!r}): {missing[1]}; use"
                         " process_group_backend='gloo' (or None: 'ccl' where oneCCL is installed, else 'gloo')")


def check_backend_device(backend: Any, device: torch.device) -> None:
    """A backend that cannot reduce the tensors of ``device`` (the Trainer's accelerator): NCCL on CPU."""
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"{OWNER}(process_group_backend='nccl') with the {device.type} accelerator: NCCL reduces"
                         " CUDA tensors only; use process_group_backend='gloo' (or None)")


__all__ = ["BACKENDS", "DEFAULT_TIMEOUT_S", "ProcessConfig", "ccl_available", "check_backend",
           "check_backend_device"]
