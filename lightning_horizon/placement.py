"""Where each rank runs: its cores and threads (pinned at setup), every rank's row gathered, and the startup table
rank 0 prints (topology, cores, threads, ISA, backend, allocator)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

from lightning_horizon import cpu, liveness
from lightning_horizon.topology import Topology, placement_table

log = logging.getLogger("lightning_horizon.strategy")


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, on every rank (``[obj]`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def place(topology: Topology, local_rank: int, ranks_here: int, pin: bool, threads: Any) -> list[dict[str, Any]]:
    """Pin this rank's cores and size its thread pool (``cpu.place``); return every rank's row (collective)."""
    row = {"rank": topology.rank, "node": topology.node_rank, "local_rank": topology.local_rank,
           **cpu.place(local_rank, ranks_here, pin, threads), "host": liveness.host(), "pid": os.getpid()}
    return all_gather_objects(row)


def startup_table(topology: Topology, placement: list[dict[str, Any]], backend: Any) -> str:
    """Topology, per-rank cores and threads, ISA, backend and allocator, as printed at fit start."""
    isa, alloc = cpu.isa(), cpu.allocator()
    header = (
        f"backend {backend}"
        f" | ISA {isa.name} (torch {isa.torch_capability}, native bf16: {'yes' if isa.native_bf16 else 'no'})"
        f" | allocator {alloc or 'glibc malloc'}"
    )
    table = placement_table(topology, placement, header)
    return table if alloc is not None else f"{table}\nhint: {cpu.ALLOCATOR_HINT}"


def report(topology: Topology, placement: list[dict[str, Any]], backend: Any, ranks_here: int) -> None:
    """Rank 0's log at setup: a warning when ranks share cores, then the startup table."""
    if any(r["shared"] for r in placement):
        log.warning(f"HorizonStrategy: {ranks_here} ranks per machine but only {len(cpu.available_cores())} cores:"
                    " ranks share cores round-robin (slower than one core each; fine for tests)")
    log.info(startup_table(topology, placement, backend))


__all__ = ["all_gather_objects", "place", "report", "startup_table"]
