"""HorizonStrategy: Lightning's DDP, made for CPU machines and CPU clusters.

It keeps DDPStrategy's whole lifecycle (launchers, samplers, no_sync on accumulation micro-steps, manual
optimization) and adds what CPUs need: a process-group backend chosen for the CPU (oneCCL when its torch
binding is installed, else gloo), per-rank core pinning and thread sizing, the node topology and its process
groups for the collectives, DDP comm hooks that are really registered on CPU, a collective timeout that ends
a job whose peer is gone, and one checkpoint key under which each part keeps its per-rank state.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Generator, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import _augment_message
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_horizon import cpu, liveness, memory
from lightning_horizon.checkpoint_io import AtomicCheckpointIO
from lightning_horizon.parts import Parts
from lightning_horizon.rng import RNGState
from lightning_horizon.state import TrainingState
from lightning_horizon.sharding import GraphSharder, ShardingConfig, resolve_sharding
from lightning_horizon.collectives import CollectivesConfig, GradientSync
from lightning_horizon.node_state import NodeState
from lightning_horizon.strategy_args import ccl_available, check_arguments, check_backend_device, check_state
from lightning_horizon.strategy_checkpoint import CheckpointParts
from lightning_horizon.store import OutOfCore, StoreConfig, resolve_store, store_folder
from lightning_horizon.topology import ProcessGroups, Topology, check_ranks_per_node, placement_table

log = logging.getLogger(__name__)

#: Collective timeout: long enough for a slow checkpoint write on rank 0 while the others wait in a barrier,
#: short enough that a lost peer ends the job instead of hanging it for torch's default 30 minutes.
DEFAULT_TIMEOUT_S = 600.0
UNUSED_PARAMETERS = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by"
    " training_step. If this is intentional, you must enable the detection of unused parameters in DDP, either by"
    " setting the string value `strategy='horizon_find_unused_parameters_true'` or by setting the flag in the"
    " strategy with `strategy=HorizonStrategy(find_unused_parameters=True)`."
)


class HorizonStrategy(CheckpointParts, DDPStrategy):
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
        state: ``"replicated"`` (every rank holds the whole training state, as DDP) or ``"node_sharded"`` (one copy
            of the weights per node in shared memory; each local rank owns a share of the parameters, balanced by
            bytes, and keeps their gradients, optimizer state and masters only). See docs/node_state.md.
        node_weights: with ``"node_sharded"``: ``"shared"`` (one copy of the weights per node in ``/dev/shm``; the
            owners write it in place) or ``"copies"`` (a copy per rank; each owner broadcasts its updated parameters
            inside the node after every step: L copies per node, no shared-memory folder needed).
        state_checkpoint: with ``"node_sharded"``: ``"full"`` (rank 0 writes one checkpoint with everything, as a
            replicated run does) or ``"per_rank"`` (each rank writes its share to ``<checkpoint>.state/``, in
            parallel, nothing gathered; loads into any layout too, as long as the folder is next to the file).
        state_store: ``None`` (training state in RAM), ``"auto"`` (out-of-core: weights, gradients, masters and
            optimizer state in memory-mapped files next to the checkpoints, streamed layer by layer), a folder
            path, or a ``StoreConfig``. See docs/out_of_core.md.
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
        state: str = "replicated",
        node_weights: str = "shared",
        state_checkpoint: str = "full",
        state_store: Union[None, str, os.PathLike, StoreConfig] = None,
        **kwargs: Any,
    ) -> None:
        # Every check runs here, in the Trainer's constructor: before a launcher starts a process or a group.
        self._sharding = resolve_sharding(sharding)
        self.collectives_config = CollectivesConfig(
            algorithm=collectives,
            compression=compression,
            sync_every=sync_every,
            sync_warmup_steps=sync_warmup_steps,
            torus_shape=torus_shape,
            cost_model=cost_model,
        )
        check_state(state, node_weights, state_checkpoint, collectives, compression, sync_every,
                    kwargs.get("ddp_comm_hook"))
        self._store_config = resolve_store(state_store)
        if self._store_config is not None and state != "replicated":
            raise ValueError(f"state_store={state_store!r} with state={state!r}: the out-of-core store holds a whole"
                             " replica per rank; use state='replicated' (the default) with it")
        seconds = check_arguments(
            ranks_per_node=ranks_per_node, bucket_size_mb=bucket_size_mb, timeout=timeout,
            process_group_backend=process_group_backend, pin_cores=pin_cores, threads_per_rank=threads_per_rank,
            checkpoint_io=checkpoint_io, collectives_changed=self.collectives_config.changed(),
            kwargs=kwargs, named=set(inspect.signature(HorizonStrategy.__init__).parameters),
        )
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
        #: the parts (lightning_horizon.parts): RNG state, gradient sync, graph sharder; per-rank state kept under
        #: one checkpoint key
        self.parts = Parts()
        self.parts.add("rng", RNGState())
        self._node_weights: Optional[dict[str, Any]] = None
        self._last_node_state: Optional[NodeState] = None  # torn down; its shares are still in the optimizers
        self._reported = False
        self._training_state = TrainingState()
        self._thread_settings: Optional[cpu.ThreadSettings] = None
        self._warn_unused = False
        self.state = state
        self._state_checkpoint = state_checkpoint
        self._node_weights_mode = node_weights
        self._sync_backward = True  # False inside block_backward_sync (accumulation micro-batches)

    # ------------------------------------------------------------------ processes, groups, cores

    @property
    def sharder(self) -> Optional[GraphSharder]:
        """The graph sharder (plan, budget, history) once setup created it; ``None`` without sharding."""
        return self.parts.get("sharding")

    @property
    def gradient_sync(self) -> Optional[GradientSync]:
        """The gradient sync (collectives, compression, local SGD, accounting) once DDP is set up on several
        ranks; ``None`` with one process or a comm hook of your own."""
        return self.parts.get("collectives")

    @property
    def store(self) -> Optional[OutOfCore]:
        """The out-of-core store (``state_store=``) once setup created it: its plan, disk figures and metrics."""
        return self.parts.get("store")

    @property
    def node_state(self) -> Optional[NodeState]:
        """The node-sharded state (owners, shared weights, gradient path) while fitting with
        ``state="node_sharded"`` on several ranks per node; ``None`` otherwise."""
        return self.parts.get("node_state")

    @property
    def node_shares(self) -> Optional[NodeState]:
        """The node-sharded state whose shares this rank's optimizers and masters hold: the fit's, and after it the
        last fit's (torn down, its ownership kept), so that ``trainer.save_checkpoint`` after fit still gathers
        every share; ``None`` when no fit was node-sharded."""
        node = self.node_state
        return node if node is not None else self._last_node_state

    def comm_metrics(self) -> dict[str, float]:
        """The last step's communication figures (bytes per link class, seconds); empty without gradient sync."""
        sync, node = self.gradient_sync, self.node_state
        return sync.metrics() if sync is not None else node.metrics() if node is not None else {}

    @property
    def nodes_diverge(self) -> bool:
        """Whether nodes hold different weights between optimizer steps (local SGD across several nodes)."""
        return self.collectives_config.sync_every > 1 and self.topology is not None and self.topology.num_nodes > 1

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
        check_backend_device(self._process_group_backend, self.root_device)
        self.collectives_config.grid_shape(self._world_size_planned, self._ranks_per_node or self.num_processes)
        # Lightning's launcher sets OMP_NUM_THREADS and torch's thread count, our pinning the affinity and the
        # OpenMP variables: teardown gives back what this process had before either, so that a notebook or a
        # script that goes on after fit finds its settings as they were.
        self._thread_settings = cpu.ThreadSettings.capture()
        super()._configure_launcher()

    @override
    def _get_process_group_backend(self) -> str:
        if self._process_group_backend:
            return self._process_group_backend
        if self.root_device.type == "cpu":
            return "ccl" if ccl_available() else "gloo"
        return super()._get_process_group_backend()

    @override
    def setup_distributed(self) -> None:
        # One process too, as DDPStrategy does: user code that builds a DistributedSampler or calls
        # torch.distributed works unchanged (a world-size-1 gloo group costs milliseconds). The model is still not
        # wrapped in DDP there (see _setup_model).
        super().setup_distributed()
        # Lightning leaves the process group up for later fits; torch 2.13's gloo group, destroyed during
        # interpreter shutdown, can abort the process ("terminate called without an active exception",
        # exit -6) after a successful run. Destroy it while Python is still whole.
        atexit.unregister(_destroy_process_group)  # once per process, however many fits
        atexit.register(_destroy_process_group)

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
        pin = self._pin_cores and self.root_device.type == "cpu"
        row = {"rank": self.global_rank, "node": self.topology.node_rank, "local_rank": self.topology.local_rank,
               **cpu.place(self.local_rank, self.num_processes, pin, self._threads_per_rank),
               "host": liveness.host(), "pid": os.getpid()}
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
        isa, alloc = cpu.isa(), cpu.allocator()
        header = (
            f"backend {self._process_group_backend}"
            f" | ISA {isa.name} (torch {isa.torch_capability}, native bf16: {'yes' if isa.native_bf16 else 'no'})"
            f" | allocator {alloc or 'glibc malloc'}"
        )
        table = placement_table(self.topology, self.placement, header)
        return table if alloc is not None else f"{table}\nhint: {cpu.ALLOCATOR_HINT}"

    # ------------------------------------------------------------------ DDP and comm hooks

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        trainer = getattr(self.lightning_module, "_trainer", None)
        if self._store_config is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            # Before DDP, the optimizers and the precision plugin: masters and optimizer state are born in the store
            part = OutOfCore(self._store_config, self.training_state, self.global_rank, lambda: self.sharder,
                             budgeted=self._sharding is not None)
            part.install(model, store_folder(self._store_config, trainer))
            self.parts.add("store", part)
        if self.world_size == 1:
            # One process: nothing to synchronize, keep the plain module. DDP's reducer would refuse parameters
            # that get no gradient; here they are harmless, but the same code on several processes will fail:
            # warn after the first step (unless the user already allows them).
            self._warn_unused = not self._ddp_kwargs.get("find_unused_parameters", False)
            return model
        if self.state == "node_sharded" and self.topology is not None and self.topology.ranks_per_node > 1:
            # No DDP: the weights move into the node's shared memory and the gradients take the owners' path
            # (node_state/). Before the optimizers and the precision plugin connect: masters only for what we own.
            assert self.process_groups is not None
            node = NodeState(model, self.process_groups, int(self._ddp_kwargs["bucket_cap_mb"] * 2**20),
                             self.training_state, self.precision_plugin, self._node_weights_mode)
            node.install()
            self.parts.add("node_state", node)
            return model
        if self.state == "node_sharded" and self.global_rank == 0:
            log.info("HorizonStrategy(state='node_sharded'): one rank per node holds everything; replicated")
        return super()._setup_model(model)

    def _comm_hook(self) -> tuple[Optional[object], Optional[Callable]]:
        """The (state, hook) pair to register on the DDP model; a user's own hook when given."""
        if self._ddp_comm_hook is not None:
            return self._ddp_comm_state, self._ddp_comm_hook
        if self.process_groups is None or self.world_size == 1:
            return None, None
        # Built on every rank here, at the same point: it may create grid groups and probe the links (collective).
        sync = GradientSync(self.collectives_config, self.process_groups, self.model.module, self.training_state)
        self.parts.add("collectives", sync)
        return sync, sync.hook

    @override
    def _register_ddp_hooks(self) -> None:
        if self.node_state is not None:
            return  # no DDP wrapper: the owners' gradient path instead
        # Lightning registers comm hooks on CUDA only and drops them silently on CPU; register on every device.
        state, hook = self._comm_hook()
        if hook is None:
            return
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self.model.register_comm_hook(state=state, hook=hook)

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
        if self.node_state is not None:
            self.node_state.setup(trainer, self.lightning_module, self.optimizers)
        if self.store is not None:
            self.store.setup(self.optimizers, trainer, self.precision_plugin)
        if self.store is None and trainer.state.fn == TrainerFn.FITTING:
            # sharding shrinks activations, not what this checks; the store checked its disk
            self._check_memory()
        if self._sharding is not None and "sharding" not in self.parts:
            # Plans at the first training_step (the first batch is what it profiles); all ranks of the node
            # share its memory. Recompute runs in backward, outside training_step's precision context: the
            # plugin re-establishes it.
            self.parts.add("sharding", GraphSharder(
                self._sharding, self.num_processes, rank=self.global_rank,
                recompute_context=getattr(self.precision_plugin, "recompute_context", None),
                state_in_memory=self.store is None,
            ))
        # Last, so that nothing in setup draws from a restored generator; Lightning's sanity check runs under
        # isolate_rng, so the next draw is the training data iterator's, as in the uninterrupted run.
        self.parts.after_setup()

    def _check_memory(self) -> None:
        """Fail at setup, on every rank, when gradients and optimizer state cannot fit, or a sharding budget in bytes
        is more than the rank can have (see memory/check.py)."""
        assert self.topology is not None and self.lightning_module is not None
        node = self.node_state
        need = memory.training_memory(
            self.lightning_module, self.optimizers, self.precision_plugin,
            owns=node.owns if node is not None else None,
            weights_shared_by=self.topology.ranks_per_node if node is not None and node.weights_mode == "shared" else 1,
        )
        sharding = self._sharding
        row = memory.rank_row(self.global_rank, self.topology.node_rank, self.num_processes, need,
                              sharding=sharding is not None, budget=sharding.budget_bytes if sharding else None)
        memory.check_fit(self._all_gather_objects(row))  # every rank decides alike: none is left waiting

    # ------------------------------------------------------------------ node-sharded state: backward and step

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self.node_state is None:
            with super().block_backward_sync():
                yield
            return
        self._sync_backward = False  # as DDP.no_sync: gradients stay local and whole until the window's last
        try:
            yield
        finally:
            self._sync_backward = True

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self.node_state is not None:
            self.node_state.pre_backward(self._sync_backward)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self.node_state is not None:
            self.node_state.post_backward()

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        node = self.node_state
        if node is None:
            return self._optimizer_step(optimizer, closure, model, **kwargs)

        # The closure (forward, backward) runs inside the step: carried gradients settle after it, before the
        # optimizer; the owners' writes to the shared weights are done before any rank of the node reads them.
        def settled() -> Any:
            out = closure()
            node.before_step()
            return out

        output = self._optimizer_step(optimizer, settled, model, **kwargs)
        node.after_step()
        return output

    def _optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._warn_unused:
            self._warn_unused = False
            warn_unused_parameters(optimizer, self.lightning_module)
        if self.lightning_module.automatic_optimization:
            self.parts.after_optimizer_step()  # manual optimization: once per batch, in training_step
        return output

    @override
    def on_exception(self, exception: BaseException) -> None:
        # DDPStrategy's explanation of the reducer's unused-parameter error, naming this strategy's switch
        Strategy.on_exception(self, exception)
        _augment_message(exception, pattern=".*Expected to have finished reduction in the prior iteration.*",
                         new_message=UNUSED_PARAMETERS)
        # A dead or hung peer surfaces as a socket error or a timeout naming no rank: name it.
        if self.placement and self.world_size > 1 and liveness.looks_like_lost_peer(exception):
            log.error(liveness.describe(self.placement, self.global_rank, self._timeout.total_seconds()))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        sharder = self.sharder
        if sharder is not None:
            # At the step boundary: the first call profiles this batch and installs the plan, later ones apply
            # a pending re-plan. Under the precision's context, so that the profile sees the step's dtypes.
            batch = args[0] if args else kwargs["batch"]
            batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
            with self.precision_plugin.train_step_context():
                sharder.maybe_plan(self.lightning_module, batch, batch_idx)
        output = super().training_step(*args, **kwargs)
        if sharder is not None:
            sharder.check_output(output)
        if not self.lightning_module.automatic_optimization:
            # Manual optimization steps its optimizers inside training_step, possibly several (a GAN's two):
            # the parts see the batch's steps once, after the last, so local SGD averages what every optimizer
            # stepped (averaging after the first let the second step node-local gradients right after it).
            self.parts.after_optimizer_step()
        return output

    @override
    def teardown(self) -> None:
        self.parts.teardown()  # the sharder uninstalls: the module leaves fit exactly as it came in
        self._last_node_state = self.node_shares
        self.parts.remove("node_state")  # the weights are the module's own again: validate/test run replicated
        self.parts.remove("store")
        super().teardown()
        if self._thread_settings is not None:
            self._thread_settings.restore()

    # ------------------------------------------------------------------ registration

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # as DDPStrategy's names: "ddp_find_unused_parameters_true" -> "horizon_find_unused_parameters_true"
        entries = [(f"{name}{suffix}", method, unused) for name, method in
                   (("horizon", "popen"), ("horizon_spawn", "spawn"), ("horizon_fork", "fork"))
                   for suffix, unused in (("", False), ("_find_unused_parameters_true", True))]
        for name, start_method, unused in entries:
            if name in strategy_registry:
                continue  # idempotent: re-importing the package must not fail
            strategy_registry.register(
                name, cls, description=f"HorizonStrategy with start_method={start_method!r}"
                f"{', find_unused_parameters=True' if unused else ''}", start_method=start_method,
                **({"find_unused_parameters": True} if unused else {}),
            )


def warn_unused_parameters(optimizer: Any, module: torch.nn.Module) -> None:
    """Warn (one process, after the first step) about parameters this optimizer steps that got no gradient."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    unused = [n for n, p in module.named_parameters() if id(p) in stepped and p.requires_grad and p.grad is None]
    if unused and len(unused) < len(stepped):  # none at all: a skipped step, not unused parameters
        rank_zero_warn(
            f"HorizonStrategy: {len(unused)} parameter(s) got no gradient in the first step ({', '.join(unused[:3])}"
            f"{', ...' if len(unused) > 3 else ''}). Harmless with one process; with several, DDP refuses them: pass"
            " `HorizonStrategy(find_unused_parameters=True)` there."
        )


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["HorizonStrategy", "DEFAULT_TIMEOUT_S"]
