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
from torch.nn.parallel import DistributedDataParallel
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import Strategy
from lightning.pytorch.utilities.exceptions import _augment_message
from typing_extensions import override

from lightning_horizon import cpu, fit_parts, liveness, placement
from lightning_horizon.checkpoint_io import AtomicCheckpointIO
from lightning_horizon.parts import Parts
from lightning_horizon.rng import RNGState
from lightning_horizon.state import TrainingState
from lightning_horizon.sharding import GraphSharder, ShardingConfig
from lightning_horizon.collectives import GradientSync
from lightning_horizon.node_state import NodeState
from lightning_horizon.options import HorizonOptions
from lightning_horizon.strategy_args import ccl_available, check_backend_device
from lightning_horizon.strategy_checkpoint import StrategyCheckpoint
from lightning_horizon.store import OutOfCore, StoreConfig
from lightning_horizon.topology import ProcessGroups, Topology, check_ranks_per_node
from lightning_horizon.unused import REDUCER_ERROR, UNUSED_PARAMETERS, warn_unused_parameters

log = logging.getLogger(__name__)

#: Collective timeout: long enough for a slow checkpoint write on rank 0 while the others wait in a barrier,
#: short enough that a lost peer ends the job instead of hanging it for torch's default 30 minutes.
DEFAULT_TIMEOUT_S = 600.0


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
        #: the strategy's own options, checked and resolved (options.py); the parts are built from them
        self.options = HorizonOptions.resolve(
            ranks_per_node=ranks_per_node, bucket_size_mb=bucket_size_mb, timeout=timeout,
            process_group_backend=process_group_backend, pin_cores=pin_cores, threads_per_rank=threads_per_rank,
            sharding=sharding, collectives=collectives, compression=compression, sync_every=sync_every,
            sync_warmup_steps=sync_warmup_steps, torus_shape=torus_shape, cost_model=cost_model, state=state,
            node_weights=node_weights, state_checkpoint=state_checkpoint, state_store=state_store,
            checkpoint_io=checkpoint_io, ddp_kwargs=kwargs,
            named=set(inspect.signature(HorizonStrategy.__init__).parameters),
        )
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
            precision_plugin=precision_plugin, process_group_backend=process_group_backend,
            timeout=self.options.timeout, bucket_cap_mb=bucket_size_mb, **kwargs,
        )
        self.topology: Optional[Topology] = None
        self.process_groups: Optional[ProcessGroups] = None
        #: per-rank facts gathered at setup (rank, node, local rank, cores, threads, shared): the startup table
        self.placement: list[dict[str, Any]] = []
        #: the parts (lightning_horizon.parts), built by fit_parts.py; per-rank state kept under one checkpoint key
        self.parts = Parts()
        self.parts.add("rng", RNGState())
        #: the checkpoint side (strategy_checkpoint.py): what a save adds, what a load hands back
        self.checkpoints = StrategyCheckpoint(self)
        self._last_node_state: Optional[NodeState] = None  # torn down; its shares are still in the optimizers
        self._reported = False
        self._training_state = TrainingState()
        self._thread_settings: Optional[cpu.ThreadSettings] = None
        self._warn_unused = False
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
        return self.options.collectives.sync_every > 1 and self.topology is not None and self.topology.num_nodes > 1

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
        check_ranks_per_node(self.options.ranks_per_node, self._world_size_planned)
        check_backend_device(self._process_group_backend, self.root_device)
        self.options.collectives.grid_shape(self._world_size_planned, self.options.ranks_per_node or self.num_processes)
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
        self.topology = Topology(world_size=self.world_size, rank=self.global_rank,
                                 ranks_per_node=self.options.ranks_per_node or self.num_processes)
        self.process_groups = ProcessGroups(self.topology)
        self._place_and_report()

    def _place_and_report(self) -> None:
        """Pin this rank's cores, gather every rank's placement, and print the startup table on rank 0."""
        assert self.topology is not None
        pin = self.options.pin_cores and self.root_device.type == "cpu"
        self.placement = placement.place(self.topology, self.local_rank, self.num_processes, pin,
                                         self.options.threads_per_rank)
        if self.global_rank == 0 and not self._reported:  # once per strategy: validate/test/predict set up again
            placement.report(self.topology, self.placement, self._process_group_backend, self.num_processes)
            self._reported = True

    def startup_table(self) -> str:
        """Topology, per-rank cores and threads, ISA, backend and allocator, as printed at fit start."""
        assert self.topology is not None
        return placement.startup_table(self.topology, self.placement, self._process_group_backend)

    # ------------------------------------------------------------------ DDP and comm hooks

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if fit_parts.before_ddp(self, model, getattr(self.lightning_module, "_trainer", None)):
            return model  # node-sharded: no DDP wrapper, the owners' gradient path instead
        if self.world_size == 1:
            # One process: nothing to synchronize, keep the plain module. DDP's reducer would refuse parameters
            # that get no gradient; here they are harmless, but the same code on several processes will fail:
            # warn after the first step (unless the user already allows them).
            self._warn_unused = not self._ddp_kwargs.get("find_unused_parameters", False)
            return model
        return super()._setup_model(model)

    def _comm_hook(self) -> tuple[Optional[object], Optional[Callable]]:
        """The (state, hook) pair to register on the DDP model; a user's own hook when given."""
        if self._ddp_comm_hook is not None:
            return self._ddp_comm_state, self._ddp_comm_hook
        if self.process_groups is None or self.world_size == 1:
            return None, None
        sync = fit_parts.gradient_sync(self, self.model.module)
        return sync, sync.hook

    @override
    def _register_ddp_hooks(self) -> None:
        if not isinstance(self.model, DistributedDataParallel):
            return  # node-sharded: the owners' gradient path instead
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
        if self.checkpoints.node_weights is not None:  # local SGD: this node's weights, from the loaded checkpoint
            self.lightning_module.load_state_dict(self.checkpoints.node_weights)
            self.checkpoints.node_weights = None
        self.parts.connect(trainer, self.lightning_module, self.optimizers)
        fit_parts.at_setup(self, trainer)
        # Last, so that nothing in setup draws from a restored generator; Lightning's sanity check runs under
        # isolate_rng, so the next draw is the training data iterator's, as in the uninterrupted run.
        self.parts.after_setup()

    # ------------------------------------------------------------------ backward and step: the parts take part

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        self._sync_backward = False  # accumulation micro-batches: gradients stay local until the window's last
        try:
            with super().block_backward_sync():
                yield
        finally:
            self._sync_backward = True

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        self.parts.pre_backward(self._sync_backward)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        self.parts.post_backward()

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # The closure (forward, backward) runs inside the step: the parts settle the gradients after it, before the
        # optimizer reads them, and finish the step's writes before anything reads the weights again.
        def settled() -> Any:
            out = closure()
            self.parts.gradients_ready()
            return out

        output = super().optimizer_step(optimizer, settled, model, **kwargs)
        self.parts.optimizer_stepped()
        if self._warn_unused:
            self._warn_unused = False
            warn_unused_parameters(optimizer, self.lightning_module)
        if self.lightning_module.automatic_optimization:
            self.parts.after_optimizer_step()  # manual optimization: once per batch, in training_step
        return output

    # ------------------------------------------------------------------ checkpoints (strategy_checkpoint.py)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self.checkpoints.before_write(checkpoint, filepath)  # every rank: the parts' per-rank state to rank 0
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        self.checkpoints.after_remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        return self.checkpoints.after_read(checkpoint, checkpoint_path)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(self.checkpoints.optimizer_states(checkpoint))

    @override
    def on_exception(self, exception: BaseException) -> None:
        # DDPStrategy's explanation of the reducer's unused-parameter error, naming this strategy's switch
        Strategy.on_exception(self, exception)
        _augment_message(exception, pattern=REDUCER_ERROR, new_message=UNUSED_PARAMETERS)
        # A dead or hung peer surfaces as a socket error or a timeout naming no rank: name it.
        if self.placement and self.world_size > 1 and liveness.looks_like_lost_peer(exception):
            log.error(liveness.describe(self.placement, self.global_rank, self._timeout.total_seconds()))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self.parts.before_training_step(self.lightning_module, batch, batch_idx,
                                        self.precision_plugin.train_step_context)
        output = super().training_step(*args, **kwargs)
        self.parts.after_training_step(output)
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
        for name in fit_parts.FIT_ONLY:  # the weights are the module's own again: validate/test run replicated
            self.parts.remove(name)
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


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["HorizonStrategy", "DEFAULT_TIMEOUT_S"]
