"""HorizonStrategy: Lightning's DDP, made for CPU machines and CPU clusters.

It keeps DDPStrategy's whole lifecycle (launchers, samplers, no_sync on accumulation micro-steps, manual
optimization) and adds what CPUs need: a process-group backend chosen for the CPU (oneCCL when its torch
binding is installed, else gloo), per-rank core pinning and thread sizing, the node topology and its process
groups for the collectives, DDP comm hooks that are really registered on CPU, a collective timeout that ends
a job whose peer is gone, and one checkpoint key under which each part keeps its per-rank state.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import logging
import os
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_horizon import cpu, liveness, memory
from lightning_horizon.checkpoint_io import AtomicCheckpointIO
from lightning_horizon.rng import RNGState
from lightning_horizon.state import TrainingState
from lightning_horizon.sharding import GraphSharder, ShardingConfig, resolve_sharding
from lightning_horizon.collectives import CollectivesConfig, GradientSync
from lightning_horizon.topology import ProcessGroups, Topology, check_ranks_per_node

log = logging.getLogger(__name__)

#: Collective timeout: long enough for a slow checkpoint write on rank 0 while the others wait in a barrier,
#: short enough that a lost peer ends the job instead of hanging it for torch's default 30 minutes.
DEFAULT_TIMEOUT_S = 600.0
_BACKENDS = ("gloo", "ccl", "mpi", "nccl")
_CHECKPOINT_KEY = "HorizonStrategy"


def _ccl_available() -> bool:
    """True when oneCCL's torch binding imports (importing it registers the ``ccl`` backend)."""
    try:
        importlib.import_module("oneccl_bindings_for_pytorch")
        return True
    except Exception:  # ImportError, or a binding built for another torch
        return False


class HorizonStrategy(DDPStrategy):
    """Multi-process data-parallel training on CPUs, topology-aware.

    Args:
        ranks_per_node: ranks per (emulated) node; ``None`` takes the launcher's local world size. Must divide
            the world size. Setting it below the launcher's lets one machine emulate several nodes.
        bucket_size_mb: DDP gradient bucket size in MiB (the unit each comm hook call reduces).
        timeout: collective timeout in seconds (or a ``timedelta``): a rank that waits longer for a peer fails.
        process_group_backend: ``"gloo"``, ``"ccl"``, ``"mpi"`` or ``"nccl"``; ``None`` picks ``ccl`` when
            ``oneccl_bindings_for_pytorch`` imports, else ``gloo`` on CPU (``nccl`` on CUDA).
        pin_cores: pin each local rank to its own contiguous slice of cores (inside one NUMA domain where the
            ranks divide the domains) and size its thread pool to it.
        threads_per_rank: intra-op threads per rank; ``None`` uses one per pinned core.
        sharding: ``None`` (off), ``"auto"`` or a ``ShardingConfig``: recompute activations, planned from the
            model's own step, so that each rank's peak memory fits a budget. See docs/sharding.md.
        collectives: how gradient buckets are reduced: ``"flat"`` (one allreduce, DDP's behaviour),
            ``"hierarchical"`` (reduce-scatter in the node, slices across nodes, all-gather in the node),
            ``"torus2d"`` (the same on an X x Y grid) or ``"auto"`` (per bucket size, by the cost model).
            See docs/collectives.md.
        compression: ``None``, ``"bf16"`` or ``"int8"``: compress the inter-node stage (all of it with
            ``"flat"``), summing in fp32, with error feedback kept in the checkpoint.
        sync_every: 1, or k > 1 for hierarchical local SGD: gradients reduced inside the node every step,
            parameters averaged across nodes every k optimizer steps.
        sync_warmup_steps: with ``sync_every > 1``, the first steps that still reduce across the world.
        torus_shape: ``(X, Y)`` for ``torus2d``, X ranks per row, X * Y = world size; ``None``: X = ranks per node.
        cost_model: link constants for ``"auto"`` instead of the setup probe: a ``CostModel`` or
            ``{"intra": (alpha_s, beta_s_per_byte), "inter": (alpha_s, beta_s_per_byte)}``.
        ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper: a DDP comm hook of your own, registered on CPU too
            (instead of ``collectives``, which must then stay at its defaults).
        **kwargs: passed to ``DDPStrategy`` and on to ``DistributedDataParallel`` (e.g. ``static_graph``).
    """

    strategy_name = "horizon"

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        *,
        ranks_per_node: Optional[int] = None,
        bucket_size_mb: float = 8,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT_S,
        process_group_backend: Optional[str] = None,
        pin_cores: bool = True,
        threads_per_rank: Optional[int] = None,
        sharding: Union[None, str, ShardingConfig] = None,
        collectives: str = "flat",
        compression: Optional[str] = None,
        sync_every: int = 1,
        sync_warmup_steps: int = 0,
        torus_shape: Optional[tuple[int, int]] = None,
        cost_model: Optional[Any] = None,
        **kwargs: Any,
    ) -> None:
        # Every check runs here, in the Trainer's constructor: before a launcher starts a process or a group.
        check_ranks_per_node(ranks_per_node)
        self._sharding = resolve_sharding(sharding)
        self.collectives_config = CollectivesConfig(
            algorithm=collectives,
            compression=compression,
            sync_every=sync_every,
            sync_warmup_steps=sync_warmup_steps,
            torus_shape=torus_shape,
            cost_model=cost_model,
        )
        if kwargs.get("ddp_comm_hook") is not None and self.collectives_config != CollectivesConfig():
            raise ValueError(
                f"ddp_comm_hook={kwargs['ddp_comm_hook']!r} with collectives={collectives!r}: give either your own"
                " hook or the collectives options, not both"
            )
        if not _finite_positive(bucket_size_mb):
            raise ValueError(f"bucket_size_mb={bucket_size_mb!r}: must be a finite number > 0 (MiB per DDP bucket)")
        if "bucket_cap_mb" in kwargs:
            value = kwargs["bucket_cap_mb"]
            raise ValueError(f"bucket_cap_mb={value!r}: not accepted; pass bucket_size_mb= (same meaning, MiB > 0)")
        _check_ddp_kwargs(kwargs)
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if not _finite_positive(seconds):
            raise ValueError(f"timeout={timeout!r}: must be a finite number of seconds > 0, or a timedelta")
        if not isinstance(pin_cores, bool):
            raise ValueError(f"pin_cores={pin_cores!r}: must be True or False")
        if checkpoint_io is not None and not isinstance(checkpoint_io, CheckpointIO):
            raise ValueError(f"checkpoint_io={checkpoint_io!r}: must be a lightning CheckpointIO or None (atomic)")
        if process_group_backend is not None and process_group_backend not in _BACKENDS:
            raise ValueError(
                f"process_group_backend={process_group_backend!r}: allowed are {_BACKENDS} or None (auto)"
            )
        if threads_per_rank is not None and (
            isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) or threads_per_rank < 1
        ):
            raise ValueError(f"threads_per_rank={threads_per_rank!r}: must be an int >= 1 or None (one per core)")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=seconds),
            bucket_cap_mb=bucket_size_mb,
            **kwargs,
        )
        self._ranks_per_node = ranks_per_node
        self._pin_cores = pin_cores
        self._threads_per_rank = threads_per_rank
        self.topology: Optional[Topology] = None
        self.process_groups: Optional[ProcessGroups] = None
        #: per-rank facts gathered at setup (rank, node, local rank, cores, threads, shared): the startup table
        self.placement: list[dict[str, Any]] = []
        #: named parts with per-rank state (state_dict/load_state_dict) kept under one checkpoint key
        self._parts: dict[str, Any] = {"rng": RNGState()}
        self._loaded_parts: Optional[dict[str, Any]] = None
        self._node_weights: Optional[dict[str, Any]] = None
        self._restored: set[str] = set()
        self._reported = False
        self._training_state = TrainingState()

    # ------------------------------------------------------------------ processes, groups, cores

    @property
    def sharder(self) -> Optional[GraphSharder]:
        """The graph sharder (plan, budget, history) once setup created it; ``None`` without sharding."""
        return self._parts.get("sharding")

    @property
    def training_state(self) -> TrainingState:
        """The owner of the true weights (see state.py): the precision plugin's when it keeps masters or Kahan
        compensations (HorizonPrecision), else the strategy's own, where every parameter is its own truth."""
        state = getattr(self.precision_plugin, "training_state", None)
        return state if isinstance(state, TrainingState) else self._training_state

    @property
    def _world_size_planned(self) -> int:
        return self.num_nodes * self.num_processes

    @override
    def _configure_launcher(self) -> None:
        # The world size is known from here on (the Trainer set devices and num_nodes): check the topology
        # before the launcher starts any process.
        check_ranks_per_node(self._ranks_per_node, self._world_size_planned)
        self.collectives_config.grid_shape(self._world_size_planned, self._ranks_per_node or self.num_processes)
        super()._configure_launcher()

    @override
    def _get_process_group_backend(self) -> str:
        if self._process_group_backend:
            return self._process_group_backend
        if self.root_device.type == "cpu":
            return "ccl" if _ccl_available() else "gloo"
        return super()._get_process_group_backend()

    @override
    def setup_distributed(self) -> None:
        if self._world_size_planned > 1:
            super().setup_distributed()
            # Lightning leaves the process group up for later fits; torch 2.13's gloo group, destroyed during
            # interpreter shutdown, can abort the process ("terminate called without an active exception",
            # exit -6) after a successful run. Destroy it while Python is still whole.
            atexit.unregister(_destroy_process_group)  # once per process, however many fits
            atexit.register(_destroy_process_group)
            return
        # One process: no process group (nothing to reduce), just the rank bookkeeping.
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.topology = Topology(
            world_size=self.world_size, rank=self.global_rank, ranks_per_node=self._ranks_per_node or self.num_processes
        )
        self.process_groups = ProcessGroups(self.topology)
        self._place_and_report()

    def _place_and_report(self) -> None:
        """Pin this rank's cores, gather every rank's placement, and print the startup table on rank 0."""
        assert self.topology is not None
        shared = False
        if self._pin_cores and self.root_device.type == "cpu":
            cores, shared = cpu.plan_cores(self.local_rank, self.num_processes, cpu.available_cores())
            threads = cpu.pin(cores, self._threads_per_rank)
        else:
            cores = sorted(cpu.available_cores())
            threads = torch.get_num_threads()
        row = {
            "rank": self.global_rank,
            "node": self.topology.node_rank,
            "local_rank": self.topology.local_rank,
            "cores": cores,
            "threads": threads,
            "shared": shared,
            "host": liveness.host(),
            "pid": os.getpid(),
        }
        self.placement = self._all_gather_objects(row)
        if any(r["shared"] for r in self.placement) and self.global_rank == 0 and not self._reported:
            log.warning(
                f"HorizonStrategy: {self.num_processes} ranks per machine but only {len(cpu.available_cores())}"
                " cores: ranks share cores round-robin (slower than one core each; fine for tests)"
            )
        if self.global_rank == 0 and not self._reported:
            log.info(self.startup_table())  # once per strategy: validate/test/predict set up again
            self._reported = True

    def _all_gather_objects(self, obj: Any) -> list[Any]:
        if not (dist.is_available() and dist.is_initialized()):
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def startup_table(self) -> str:
        """Topology, per-rank cores and threads, ISA, backend and allocator, as printed at fit start."""
        assert self.topology is not None
        isa = cpu.isa()
        alloc = cpu.allocator()
        lines = [
            f"HorizonStrategy: {self.topology.num_nodes} node(s) x {self.topology.ranks_per_node} rank(s)"
            f" | backend {self._process_group_backend or 'none (1 process)'}"
            f" | ISA {isa.name} (torch {isa.torch_capability}, native bf16: {'yes' if isa.native_bf16 else 'no'})"
            f" | allocator {alloc or 'glibc malloc'}",
            f"{'rank':>5} {'node':>5} {'local':>6} {'threads':>8}  cores",
        ]
        for r in self.placement:
            lines.append(
                f"{r['rank']:>5} {r['node']:>5} {r['local_rank']:>6} {r['threads']:>8}  {_cpulist(r['cores'])}"
                + ("  (shared)" if r["shared"] else "")
            )
        if alloc is None:
            lines.append(f"hint: {cpu.ALLOCATOR_HINT}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ DDP and comm hooks

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.world_size == 1:
            return model  # one process: nothing to synchronize, keep the plain module
        return super()._setup_model(model)

    def _comm_hook(self) -> tuple[Optional[object], Optional[Callable]]:
        """The (state, hook) pair to register on the DDP model; a user's own hook when given."""
        if self._ddp_comm_hook is not None:
            return self._ddp_comm_state, self._ddp_comm_hook
        if self.process_groups is None or self.world_size == 1:
            return None, None
        # Built on every rank here, at the same point: it may create grid groups and probe the links (collective).
        sync = GradientSync(self.collectives_config, self.process_groups, self.model.module, self.training_state)
        self._parts["collectives"] = sync
        return sync, sync.hook

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks on CUDA only and drops them silently on CPU; register on every device.
        state, hook = self._comm_hook()
        if hook is None:
            return
        _register_ddp_comm_hook(
            model=self.model, ddp_comm_state=state, ddp_comm_hook=hook, ddp_comm_wrapper=self._ddp_comm_wrapper
        )

    @override
    def setup(self, trainer: Any) -> None:
        if self.world_size > 1:
            super().setup(trainer)
        else:
            # One process: the base Strategy's setup (precision, optimizers) without DDP's wrapping and without
            # DDPStrategy's broadcast of module states, which needs a process group.
            Strategy.setup(self, trainer)
        if self._node_weights is not None:
            self.lightning_module.load_state_dict(self._node_weights)
            self._node_weights = None
        if self._sharding is None and trainer.state.fn == TrainerFn.FITTING:
            self._check_memory()  # with sharding, the first plan checks this and the activations too
        if self._sharding is not None and "sharding" not in self._parts:
            # Plans at the first training_step (the first batch is what it profiles); all ranks of the node
            # share its memory.
            # Recompute runs in backward, outside training_step's precision context: the plugin re-establishes it.
            self._parts["sharding"] = GraphSharder(
                self._sharding, self.num_processes, rank=self.global_rank,
                recompute_context=getattr(self.precision_plugin, "recompute_context", None),
            )
        self._restore_parts()
        # Last, so that nothing in setup draws from a restored generator; Lightning's sanity check runs under
        # isolate_rng, so the next draw is the training data iterator's, as in the uninterrupted run.
        for part in self._parts.values():
            if hasattr(part, "after_setup"):
                part.after_setup()
        self._loaded_parts, self._restored = None, set()

    def _check_memory(self) -> None:
        """Fail at setup, on every rank, when gradients and optimizer state cannot fit (see memory/check.py)."""
        assert self.topology is not None and self.lightning_module is not None
        need = memory.training_memory(self.lightning_module, self.optimizers, self.precision_plugin)
        row = memory.rank_row(self.global_rank, self.topology.node_rank, self.num_processes, need)
        memory.check_fit(self._all_gather_objects(row))  # every rank decides alike: none is left waiting

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        for part in self._parts.values():
            if hasattr(part, "after_optimizer_step"):
                part.after_optimizer_step()
        return output

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # A dead or hung peer surfaces as a socket error or a timeout naming no rank: name it.
        if self.placement and self.world_size > 1 and liveness.looks_like_lost_peer(exception):
            log.error(liveness.describe(self.placement, self.global_rank, self._timeout.total_seconds()))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        sharder = self._parts.get("sharding")
        if sharder is not None:
            # At the step boundary: the first call profiles this batch and installs the plan, later ones apply
            # a pending re-plan. Under the precision's context, so that the profile sees the step's dtypes.
            batch = args[0] if args else kwargs["batch"]
            batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
            with self.precision_plugin.train_step_context():
                sharder.maybe_plan(self.lightning_module, batch, batch_idx)
            return sharder.check_output(super().training_step(*args, **kwargs))
        return super().training_step(*args, **kwargs)

    @override
    def teardown(self) -> None:
        sharder = self._parts.get("sharding")
        if sharder is not None:
            sharder.uninstall()  # the module leaves fit exactly as it came in
        super().teardown()

    # ------------------------------------------------------------------ checkpoint state of the parts

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        # Called on every rank; the parts' state differs per rank (RNG, error feedback, plans), so gather it
        # to rank 0, which writes the file.
        sync = self._parts.get("collectives")
        if sync is not None:
            sync.settle_layout(self.model)  # the bucket layout the next step reduces in (collective on every rank)
        states = {name: part.state_dict() for name, part in self._parts.items()}
        if self._nodes_diverge() and self.topology.local_rank == 0 and self.topology.node_rank > 0:
            # Between local-SGD averages every node has its own weights, optimizer and precision state, and
            # Lightning writes rank 0's: the first rank of every other node adds its node's (see load_checkpoint).
            states["node"] = {k: checkpoint[k] for k in self._node_keys() if k in checkpoint}
        ranks = self._gather_objects(states)
        if ranks is not None:
            checkpoint[_CHECKPOINT_KEY] = {"world_size": self.world_size, "ranks": ranks}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = self._loaded_parts = checkpoint.get(_CHECKPOINT_KEY)
        self._restore_parts()  # parts that exist already; the others are restored when setup creates them
        if saved is not None and saved["world_size"] == self.world_size and self._nodes_diverge():
            # Lightning restores the weights, optimizer and precision state from this dict: give it this node's.
            node = saved["ranks"][self.topology.node_rank * self.topology.ranks_per_node].get("node")
            if node:
                checkpoint = {**checkpoint, **node}
                # DDP's constructor broadcasts rank 0's weights: setup puts this node's back after it
                self._node_weights = node.get("state_dict")
        return checkpoint

    def _nodes_diverge(self) -> bool:
        """Whether nodes hold different weights between steps (local SGD across several nodes)."""
        return self.collectives_config.sync_every > 1 and self.topology is not None and self.topology.num_nodes > 1

    def _node_keys(self) -> tuple[str, ...]:
        return ("state_dict", "optimizer_states", type(self.precision_plugin).__qualname__)

    def _gather_objects(self, obj: Any) -> Optional[list[Any]]:
        """Every rank's ``obj`` on rank 0 (``None`` elsewhere): only rank 0 writes the checkpoint."""
        if not (dist.is_available() and dist.is_initialized()):
            return [obj]
        out: Optional[list[Any]] = [None] * dist.get_world_size() if self.global_rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def _restore_parts(self) -> None:
        """Give each existing part its saved state, once; parts created later get theirs when they appear."""
        saved = self._loaded_parts
        if saved is None:
            return
        if saved["world_size"] != self.world_size:
            log.warning(
                f"HorizonStrategy: checkpoint saved with world size {saved['world_size']}, resuming with"
                f" {self.world_size}: per-rank state (RNG, collectives, sharding) starts fresh"
            )
            self._loaded_parts = None
            return
        mine = saved["ranks"][self.global_rank]
        for name, part in self._parts.items():
            if name in mine and name not in self._restored:
                part.load_state_dict(mine[name])
                self._restored.add(name)

    # ------------------------------------------------------------------ registration

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        entries = (("horizon", "popen"), ("horizon_spawn", "spawn"), ("horizon_fork", "fork"))
        for name, start_method in entries:
            if name in strategy_registry:
                continue  # idempotent: re-importing the package must not fail
            strategy_registry.register(
                name, cls, description=f"HorizonStrategy with start_method={start_method!r}", start_method=start_method
            )


def _finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf")


_START_METHODS = ("popen", "spawn", "fork", "forkserver")


def _check_ddp_kwargs(kwargs: dict[str, Any]) -> None:
    """The keywords HorizonStrategy hands on to DDPStrategy and DistributedDataParallel, checked by name now:
    a misspelt one would otherwise fail in DDP's constructor, after every process has started."""
    if "start_method" in kwargs and kwargs["start_method"] not in _START_METHODS:
        raise ValueError(f"start_method={kwargs['start_method']!r}: allowed are {_START_METHODS}")
    known = set(inspect.signature(DDPStrategy.__init__).parameters)
    known |= set(inspect.signature(DistributedDataParallel.__init__).parameters)
    known -= set(inspect.signature(HorizonStrategy.__init__).parameters)  # named, never in kwargs
    known -= {"module", "device_ids", "bucket_cap_mb"}  # the strategy passes these itself
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"{unknown[0]}={kwargs[unknown[0]]!r}: not a HorizonStrategy, DDPStrategy or DistributedDataParallel"
            f" argument; allowed extra keywords are {sorted(known)}"
        )


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _cpulist(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    spans: list[str] = []
    for c in sorted(cores):
        if spans and int(spans[-1].split("-")[-1]) == c - 1:
            spans[-1] = f"{spans[-1].split('-')[0]}-{c}"
        else:
            spans.append(str(c))
    return ",".join(spans)


__all__ = ["HorizonStrategy", "DEFAULT_TIMEOUT_S"]
