"""HorizonStrategy's arguments, checked in the Trainer's constructor: before a launcher starts a process or a group.

Besides its own arguments, the strategy hands extra keywords on to DDPStrategy and DistributedDataParallel; they
are checked by name here too, since a misspelt one would otherwise fail in DDP's constructor, after every
process has started.
"""

from __future__ import annotations

import importlib
import inspect
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from lightning_horizon.checks import check_one_of, is_int, is_number, require
from lightning_horizon.topology import check_ranks_per_node

OWNER = "HorizonStrategy"
STATES = ("replicated", "node_sharded")
STATE_CHECKPOINTS = ("full", "per_rank")
NODE_WEIGHTS = ("shared", "copies")
#: the collectives a node-sharded run accepts: its gradient path (node_state/reduce.py) is always two-level
NODE_SHARDED_COLLECTIVES = ("flat", "hierarchical", "auto")
BACKENDS = ("gloo", "ccl", "mpi", "nccl")
START_METHODS = ("popen", "spawn", "fork", "forkserver")


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


def check_arguments(
    *,
    ranks_per_node: Any,
    bucket_size_mb: Any,
    timeout: Any,
    process_group_backend: Any,
    pin_cores: Any,
    threads_per_rank: Any,
    keep_freed_memory: Any,
    checkpoint_io: Any,
    collectives_changed: list[str],
    kwargs: dict[str, Any],
    named: set[str],
) -> float:
    """Raise ValueError for the first bad argument; return the timeout in seconds. ``named``: the strategy's own
    parameter names (never extra keywords); ``collectives_changed``: the collectives options away from their
    defaults, as arguments."""
    check_ranks_per_node(ranks_per_node)
    if kwargs.get("ddp_comm_hook") is not None and collectives_changed:
        raise ValueError(
            f"ddp_comm_hook={kwargs['ddp_comm_hook']!r} with {', '.join(collectives_changed)}: give either your own"
            " hook or the collectives options, not both"
        )
    require(is_number(bucket_size_mb, 0), OWNER, "bucket_size_mb", bucket_size_mb,
            "a finite number > 0 (MiB per DDP bucket)")
    if "bucket_cap_mb" in kwargs:
        value = kwargs["bucket_cap_mb"]
        raise ValueError(f"bucket_cap_mb={value!r}: not accepted; pass bucket_size_mb= (same meaning, MiB > 0)")
    check_ddp_kwargs(kwargs, named)
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    require(is_number(seconds, 0), OWNER, "timeout", timeout, "a finite number of seconds > 0, or a timedelta")
    require(isinstance(pin_cores, bool), OWNER, "pin_cores", pin_cores, "True or False")
    require(isinstance(keep_freed_memory, bool), OWNER, "keep_freed_memory", keep_freed_memory, "True or False")
    require(checkpoint_io is None or isinstance(checkpoint_io, CheckpointIO), OWNER, "checkpoint_io", checkpoint_io,
            "a lightning CheckpointIO or None (atomic)")
    check_backend(process_group_backend)
    require(threads_per_rank is None or is_int(threads_per_rank, 1), OWNER, "threads_per_rank", threads_per_rank,
            "an int >= 1 or None (one per core)")
    return float(seconds)


def check_heartbeat(heartbeat_timeout: Any) -> Optional[float]:
    """``heartbeat_timeout``: seconds > 0, or ``None`` (no heartbeat)."""
    require(heartbeat_timeout is None or is_number(heartbeat_timeout, 0), OWNER, "heartbeat_timeout",
            heartbeat_timeout, "a finite number of seconds > 0, or None (no heartbeat)")
    return None if heartbeat_timeout is None else float(heartbeat_timeout)


def check_ddp_kwargs(kwargs: dict[str, Any], named: set[str]) -> None:
    """The keywords handed on to DDPStrategy and DistributedDataParallel, checked by name."""
    if "start_method" in kwargs:
        check_one_of(OWNER, "start_method", kwargs["start_method"], START_METHODS)
    known = set(inspect.signature(DDPStrategy.__init__).parameters)
    known |= set(inspect.signature(DistributedDataParallel.__init__).parameters)
    known -= named  # the strategy's own parameters are never extra keywords
    known -= {"module", "device_ids", "bucket_cap_mb"}  # the strategy passes these itself
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"{unknown[0]}={kwargs[unknown[0]]!r}: not a HorizonStrategy, DDPStrategy or DistributedDataParallel"
            f" argument; allowed extra keywords are {sorted(known)}"
        )


def check_state(
    state: Any, node_weights: Any, state_checkpoint: Any, shard_group_nodes: Any, collectives: Any, compression: Any,
    sync_every: Any, ddp_comm_hook: Any,
) -> None:
    """``state`` is one of :data:`STATES`; ``"node_sharded"`` refuses, by name, the options its gradient path does
    not implement."""
    check_one_of(OWNER, "state", state, STATES)
    check_one_of(OWNER, "node_weights", node_weights, NODE_WEIGHTS)
    check_one_of(OWNER, "state_checkpoint", state_checkpoint, STATE_CHECKPOINTS)
    require(shard_group_nodes == "auto" or is_int(shard_group_nodes, 1), OWNER, "shard_group_nodes",
            shard_group_nodes, "'auto' or an int >= 1 dividing the number of nodes")
    if state != "node_sharded":
        for name, value, default in (("node_weights", node_weights, "shared"),
                                     ("state_checkpoint", state_checkpoint, "full"),
                                     ("shard_group_nodes", shard_group_nodes, "auto")):
            if value != default:
                raise ValueError(f"{name}={value!r} with state={state!r}: an option of state='node_sharded'; leave"
                                 f" it at {default!r} or pass state='node_sharded'")
        return
    why = "node_sharded reduces each gradient bucket to its owner in the node, then across nodes among owners"
    if collectives not in NODE_SHARDED_COLLECTIVES:
        raise ValueError(f"collectives={collectives!r} with state='node_sharded': not supported ({why}); allowed:"
                         f" {', '.join(map(repr, NODE_SHARDED_COLLECTIVES))}, or state='replicated'")
    if compression is not None:
        raise ValueError(f"compression={compression!r} with state='node_sharded': not supported ({why}, uncompressed);"
                         " use compression=None, or state='replicated'")
    if sync_every != 1:
        raise ValueError(f"sync_every={sync_every!r} with state='node_sharded': not supported (local SGD averages"
                         " every rank's whole weights); use sync_every=1, or state='replicated'")
    if ddp_comm_hook is not None:
        raise ValueError(f"ddp_comm_hook={ddp_comm_hook!r} with state='node_sharded': the node-sharded gradient path"
                         " replaces DDP's; use state='replicated' for a hook of your own")


def check_world(options: Any, world: int, ranks_here: int, backend: Any, device: torch.device) -> None:
    """What the world size decides, checked before the launcher starts any process: ``ranks_per_node`` divides it,
    ``shard_group_nodes`` divides the number of nodes, the backend reduces ``device``'s tensors, the torus grid fits
    and, with compression, has a stage to compress."""
    check_ranks_per_node(options.ranks_per_node, world)
    check_backend_device(backend, device)
    per_node = options.ranks_per_node or ranks_here
    nodes, k = world // per_node, options.shard_group_nodes
    if k != "auto" and nodes % k:
        raise ValueError(f"{OWNER}(shard_group_nodes={k!r}) on {nodes} node{'s' if nodes > 1 else ''}: must divide"
                         f" the number of nodes; allowed are {[d for d in range(1, nodes + 1) if nodes % d == 0]}"
                         " or 'auto'")
    c = options.collectives
    x, y = c.grid_shape(world, per_node)
    if c.collectives == "torus2d" and c.compression is not None and y == 1 and x > per_node:
        # only the column stage is compressed; one row that spans nodes sends every byte across them uncompressed
        raise ValueError(f"{OWNER}(collectives='torus2d', torus_shape={c.torus_shape!r}, compression="
                         f"{c.compression!r}): a grid of one row spanning {x // per_node} nodes has no column stage,"
                         " the only one compressed, so nothing would be; use a torus_shape with Y > 1, or"
                         " collectives='hierarchical'")


def register_names(cls: type, registry: Any) -> None:
    """DDPStrategy's names for ``cls``: "horizon", "horizon_spawn", "horizon_fork", each also with
    "_find_unused_parameters_true" (as "ddp_find_unused_parameters_true"); registering twice is harmless."""
    entries = [(f"{name}{suffix}", method, unused) for name, method in
               (("horizon", "popen"), ("horizon_spawn", "spawn"), ("horizon_fork", "fork"))
               for suffix, unused in (("", False), ("_find_unused_parameters_true", True))]
    for name, start_method, unused in entries:
        if name not in registry:  # re-importing the package must not fail
            registry.register(name, cls, description=f"HorizonStrategy with start_method={start_method!r}"
                              f"{', find_unused_parameters=True' if unused else ''}", start_method=start_method,
                              **({"find_unused_parameters": True} if unused else {}))


__all__ = ["BACKENDS", "STATES", "check_state", "START_METHODS", "ccl_available", "check_arguments", "check_backend",
           "check_backend_device", "check_ddp_kwargs", "check_world", "register_names"]
