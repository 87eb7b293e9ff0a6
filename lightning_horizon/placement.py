"""Where each rank runs: its topology and process groups, its cores and threads (pinned at setup), every rank's row
gathered, and the startup table rank 0 prints (topology, cores, threads, ISA, backend, allocator)."""

from __future__ import annotations

import atexit
import logging
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_horizon import cpu, liveness
from lightning_horizon.layout.cache import cache_path
from lightning_horizon.topology import ProcessGroups, Topology, cpulist, placement_table

log = logging.getLogger("lightning_horizon.strategy")


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, on every rank (``[obj]`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def place_ranks(topology: Topology, local_rank: int, ranks_here: int, pin: bool, threads: Any,
                keep_freed: bool) -> list[dict[str, Any]]:
    """Pin this rank's cores and size its thread pool (``cpu.pin_rank``), have malloc keep freed memory where asked
    (``cpu.keep_freed_memory``); return every rank's row (collective)."""
    row = {"rank": topology.rank, "node": topology.node_rank, "local_rank": topology.local_rank,
           **cpu.pin_rank(local_rank, ranks_here, pin, threads), "host": liveness.host(), "pid": os.getpid(),
           "keeps_freed_memory": keep_freed and cpu.keep_freed_memory()}
    return all_gather_objects(row)


def start(options: Any, world_size: int, rank: int, local_rank: int, ranks_here: int, device: Any, backend: Any,
          report_here: bool) -> tuple[Topology, ProcessGroups, list[dict[str, Any]]]:
    """This rank's topology and process groups, its cores and threads pinned (``options.process.pin_cores`` on CPU),
    its malloc keeping freed memory (``options.process.keep_freed_memory`` on CPU, without graph sharding: its budget
    measures RSS that follows the tensors), every rank's row; rank 0 reports when ``report_here`` (collective)."""
    process = options.process
    topology = Topology(world_size=world_size, rank=rank, ranks_per_node=process.ranks_per_node or ranks_here)
    groups = ProcessGroups(topology)
    cpu_here = device.type == "cpu"
    rows = place_ranks(topology, local_rank, ranks_here, process.pin_cores and cpu_here, process.threads_per_rank,
                       process.keep_freed_memory and cpu_here and options.sharding is None)
    if report_here:
        report(topology, rows, backend, ranks_here, options.process.threads_per_rank)
    return topology, groups, rows


def attempt() -> int:
    """Which attempt of the job this process belongs to: torchrun's restart count (0 at the first start and
    outside torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def attempt_prefix() -> str:
    """The key prefix of this attempt on the rendezvous store: every attempt writes and reads its own keys."""
    return f"horizon/attempt{attempt()}/"


def agent_store_kept() -> bool:
    """Whether the rendezvous store outlives the worker processes: torchrun's agent serves it
    (``TORCHELASTIC_USE_AGENT_STORE``), and with its static rendezvous the same store serves every restart."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def init_process_group(address: str, port: int, backend: str, rank: int, world_size: int,
                       timeout: timedelta) -> bool:
    """Start the default process group on a store of this attempt's own, where the store outlives an attempt
    (``agent_store_kept``); ``False`` (nothing done: Lightning starts it) elsewhere.

    torchrun's static rendezvous (``--max-restarts`` without ``--rdzv-backend``) hands every restart the same agent
    store, and ``init_process_group(env://)`` writes its keys there without a prefix: gloo's full mesh of a restarted
    attempt can read the address a rank of the previous attempt published (its process gone) before the new rank
    overwrites it, and fails with ``connectFullMesh ... Connection refused``; the store barrier counts the previous
    attempt's arrivals too. Under a prefix per attempt every key is fresh."""
    if not agent_store_kept() or dist.is_initialized():
        return False
    client = dist.TCPStore(address, port, world_size=world_size, is_master=False, timeout=timeout)
    store = dist.PrefixStore(attempt_prefix() + "pg", client)
    log.debug(f"HorizonStrategy: process group of attempt {attempt()} on {address}:{port}")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return True


def destroy_process_group_at_exit() -> None:
    """Lightning leaves the process group up for later fits; torch 2.13's gloo group, destroyed during interpreter
    shutdown, can abort the process (exit -6) after a successful run: destroy it while Python is still whole (once
    per process, however many fits)."""
    atexit.unregister(_destroy_process_group)
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def startup_table(topology: Topology, placement: list[dict[str, Any]], backend: Any) -> str:
    """Topology, per-rank cores and threads, ISA, backend and allocator, as printed at fit start."""
    isa, alloc = cpu.isa(), cpu.allocator()
    kept = ", keeps freed memory" if placement[0].get("keeps_freed_memory") else ""
    header = (
        f"backend {backend}"
        f" | ISA {isa.name} (torch {isa.torch_capability}, native bf16: {'yes' if isa.native_bf16 else 'no'})"
        f" | allocator {alloc or 'glibc malloc'}{kept}"
    )
    return placement_table(topology, placement, header)


def allocator_hint_due() -> bool:
    """Whether to print the allocator hint: under glibc's malloc, once per machine (a file beside the layout
    cache, ``~/.cache/lightning_horizon/allocator-hint-shown``, remembers it was)."""
    if cpu.allocator() is not None:
        return False
    marker = cache_path().parent / "allocator-hint-shown"
    if marker.exists():
        return False
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass  # an unwritable cache folder: shown again next time
    return True


def report(topology: Topology, placement: list[dict[str, Any]], backend: Any, ranks_here: int,
           threads_per_rank: Any = None) -> None:
    """Rank 0's log at setup: a warning when ranks share cores or run more threads than they have cores, then the
    startup table (and, once per machine, the allocator hint)."""
    if any(r["shared"] for r in placement):
        log.warning(f"HorizonStrategy: {ranks_here} ranks per machine but only {len(cpu.available_cores())} cores:"
                    " ranks share cores round-robin (slower than one core each; fine for tests)")
    elif over := [r for r in placement if r["threads"] > len(r["cores"])]:
        r = over[0]
        given = (f"HorizonStrategy(threads_per_rank={threads_per_rank})" if threads_per_rank is not None
                 else "HorizonStrategy: torch's thread count (OMP_NUM_THREADS)")
        fix = ("threads_per_rank=None (one thread per core)" if threads_per_rank is not None
               else f"OMP_NUM_THREADS={len(r['cores'])} or threads_per_rank={len(r['cores'])}")
        more = f", {len(over) - 1} more rank(s) alike" if len(over) > 1 else ""
        log.warning(f"{given}: rank {r['rank']} runs {r['threads']} threads on {len(r['cores'])} cores"
                    f" ({cpulist(r['cores'])}){more}: threads beyond the cores take turns and slow every step;"
                    f" use {fix}")
    table = startup_table(topology, placement, backend)
    log.info(f"{table}\nhint: {cpu.ALLOCATOR_HINT}" if allocator_hint_due() else table)


__all__ = ["agent_store_kept", "all_gather_objects", "allocator_hint_due", "attempt", "attempt_prefix",
           "destroy_process_group_at_exit", "init_process_group", "place_ranks", "report", "start", "startup_table"]
