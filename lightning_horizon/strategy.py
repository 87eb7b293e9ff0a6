"""HorizonStrategy: Lightning's DDP, made for CPU machines and CPU clusters.

DDPStrategy's whole lifecycle, plus what CPUs need: a backend chosen for the CPU, core pinning, the node topology,
comm hooks really registered on CPU, a timeout that ends a job whose peer is gone, a heartbeat that ends one whose
peer hangs (heartbeat.py), and the parts (parts.py) a fit is made of (fit_parts.py), each keeping its per-rank state
under one checkpoint key.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Generator, Optional, Union

import torch
from torch.nn.parallel import DistributedDataParallel
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import Strategy
from typing_extensions import override

from lightning_horizon import cpu, fit_parts, heartbeat, liveness, placement
from lightning_horizon.checks import require
from lightning_horizon.collectives import CollectivesConfig
from lightning_horizon.data_position import DataPositions
from lightning_horizon.checkpoint_io import AtomicCheckpointIO
from lightning_horizon.parts import Parts, part
from lightning_horizon.precision import HorizonPrecision
from lightning_horizon.state import TrainingState
from lightning_horizon.sharding import ShardingConfig
from lightning_horizon.node_state import NodeState
from lightning_horizon.node_state.config import NodeStateConfig
from lightning_horizon.options import HorizonOptions
from lightning_horizon.process_config import DEFAULT_TIMEOUT_S, ProcessConfig, ccl_available
from lightning_horizon.strategy_checkpoint import CHECKPOINT_KEY, StrategyCheckpoint
from lightning_horizon.store import StoreConfig
from lightning_horizon.store.materialize import deferred_init, is_meta
from lightning_horizon.topology import ProcessGroups, Topology
from lightning_horizon.unused import explain_unused

class HorizonStrategy(DDPStrategy):
    """Multi-process data-parallel training on CPUs, topology-aware. Every keyword is a field of the same name of one
    config, which documents and checks it: :class:`~lightning_horizon.process_config.ProcessConfig` (ranks per node,
    buckets, timeout, backend, cores and threads, freed memory, heartbeat),
    :class:`~lightning_horizon.collectives.CollectivesConfig` (collectives, compression, local SGD and the outer
    sync, torus, cost model), :class:`~lightning_horizon.node_state.config.NodeStateConfig` (state, node weights,
    state checkpoint, shard groups); ``sharding`` is a ``ShardingConfig`` (or ``"auto"``), ``state_store`` a
    ``StoreConfig`` (or ``"auto"``, a folder). The rules between them: options.py; all of it: docs/strategy.md.
    ``ddp_comm_state``, ``ddp_comm_hook``, ``ddp_comm_wrapper``: a DDP comm hook of your own, registered on CPU too;
    other keywords go to ``DDPStrategy`` and on to ``DistributedDataParallel`` (e.g. ``static_graph``).
    """

    strategy_name = "horizon"

    def __init__(
        self, accelerator: Optional[Any] = None, parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None, checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None, *,
        ranks_per_node: Optional[int] = None,
        bucket_size_mb: float = 8,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT_S,
        process_group_backend: Optional[str] = None,
        pin_cores: bool = True,
        threads_per_rank: Optional[int] = None,
        keep_freed_memory: bool = True,
        heartbeat_timeout: Optional[float] = heartbeat.DEFAULT_TIMEOUT_S,
        sharding: Union[None, str, ShardingConfig] = None,
        collectives: str = "flat",
        compression: Optional[str] = None,
        sync_every: int = 1,
        sync_warmup_steps: int = 0,
        outer: str = "average",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        sync_overlap: Union[bool, str] = False,
        torus_shape: Optional[tuple[int, int]] = None,
        cost_model: Optional[Any] = None,
        state: str = "replicated",
        node_weights: str = "shared",
        state_checkpoint: str = "full",
        shard_group_nodes: Union[str, int] = "auto",
        state_store: Union[None, str, os.PathLike, StoreConfig] = None,
        **kwargs: Any,
    ) -> None:
        # Every check runs here, in the Trainer's constructor: before a launcher starts a process or a group.
        require(checkpoint_io is None or isinstance(checkpoint_io, CheckpointIO), "HorizonStrategy", "checkpoint_io",
                checkpoint_io, "a lightning CheckpointIO or None (atomic)")
        #: the strategy's own options, each group's checked by its config and the rules between them (options.py)
        self.options = HorizonOptions(
            process=ProcessConfig(
                ranks_per_node=ranks_per_node, bucket_size_mb=bucket_size_mb, timeout=timeout,
                process_group_backend=process_group_backend, pin_cores=pin_cores, threads_per_rank=threads_per_rank,
                keep_freed_memory=keep_freed_memory, heartbeat_timeout=heartbeat_timeout),
            collectives=CollectivesConfig(
                collectives=collectives, compression=compression, sync_every=sync_every,
                sync_warmup_steps=sync_warmup_steps, outer=outer, outer_lr=outer_lr, outer_momentum=outer_momentum,
                sync_overlap=sync_overlap, torus_shape=torus_shape, cost_model=cost_model),
            node_state=NodeStateConfig(state=state, node_weights=node_weights, state_checkpoint=state_checkpoint,
                                       shard_group_nodes=shard_group_nodes),
            sharding=sharding, state_store=state_store, ddp_kwargs=kwargs)
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
            precision_plugin=precision_plugin, process_group_backend=process_group_backend,
            timeout=self.options.process.timeout, bucket_cap_mb=bucket_size_mb, **kwargs,
        )
        self.topology: Optional[Topology] = None
        self.process_groups: Optional[ProcessGroups] = None
        #: per-rank facts gathered at setup (rank, node, local rank, cores, threads, shared): the startup table
        self.placement: list[dict[str, Any]] = []
        #: the owner of the true weights (state.py), one per strategy: handed to the precision plugin and every part
        self.training_state = TrainingState()
        #: the parts (parts.py), built by fit_parts.py; their per-rank state is kept under one checkpoint key
        self.parts: Parts = fit_parts.at_construction()
        #: the checkpoint side (strategy_checkpoint.py): what a save adds, what a load hands back
        self.checkpoints = StrategyCheckpoint(self)
        #: the training data's position (data_position.py): loaders that resume mid-epoch, into any world size
        self.data_positions = DataPositions()
        #: this rank's heartbeat while a stage runs (heartbeat.py), ``None`` without; the hooks below beat it
        self.heartbeat: Optional[heartbeat.Heartbeat] = None
        self._reported = False
        self._thread_settings: Optional[cpu.ThreadSettings] = None
        self._sync_backward = True  # False inside block_backward_sync (accumulation micro-batches)
        self._restore_after_setup: Optional[bool] = None  # restore_checkpoint_after_setup, for this fit

    # ------------------------------------------------------------------ the parts, by what they do

    sharder = part("sharding", "The graph sharder (plan, budget, history) once setup made it; ``None`` without.")
    gradient_sync = part("collectives", "The gradient sync (collectives, compression, local SGD) under DDP, with no"
                         " comm hook of yours; else ``None``.")
    store = part("store", "The out-of-core store (``state_store=``) while fitting: its plan, disk figures, metrics.")
    node_state = part("node_state", "The node-sharded state (owners, shared weights, gradient path) while fitting.")

    @property
    def node_shares(self) -> Optional[NodeState]:
        """The node-sharded state whose shares this rank's optimizers hold: the fit's, after it the last fit's (so
        that ``trainer.save_checkpoint`` after fit gathers every share); ``None`` when no fit was node-sharded."""
        return self.parts.last("node_state")

    def comm_metrics(self) -> dict[str, float]:
        """The last step's communication figures (bytes per link class, seconds); empty without communication."""
        return self.parts.comm_metrics()

    @property
    def nodes_diverge(self) -> bool:
        """Whether nodes hold different weights between optimizer steps (local SGD across several nodes)."""
        return self.options.collectives.sync_every > 1 and self.topology is not None and self.topology.num_nodes > 1

    # ------------------------------------------------------------------ processes, groups, cores

    @override
    def _configure_launcher(self) -> None:
        self.options.check_world(self.num_nodes * self.num_processes, self.num_processes, self.root_device)
        # teardown gives back the threads, affinity and OpenMP variables of before (a notebook goes on after fit)
        self._thread_settings = cpu.ThreadSettings.capture()
        if self.options.process.pin_cores and self.root_device.type == "cpu":
            # the count pinning gives rank 0, for Lightning's launcher: with OMP_NUM_THREADS set it leaves
            # torch.set_num_threads alone (a call costs even where the count is unchanged: cpu.set_threads), and the
            # ranks it starts begin with it
            os.environ.setdefault("OMP_NUM_THREADS",
                                  str(cpu.planned_threads(0, self.num_processes, self.options.process.threads_per_rank)))
        super()._configure_launcher()

    @override
    def _get_process_group_backend(self) -> str:
        if self._process_group_backend or self.root_device.type != "cpu":
            return super()._get_process_group_backend()
        return "ccl" if ccl_available() else "gloo"

    @override
    def setup_distributed(self) -> None:
        # one process too, as DDPStrategy: a DistributedSampler or torch.distributed call works unchanged; under
        # torchrun's agent store on a store of this restart attempt's own (placement.init_process_group)
        self.set_world_ranks()
        placement.init_process_group(self.cluster_environment.main_address, self.cluster_environment.main_port,
                                     self._get_process_group_backend(), self.global_rank, self.world_size,
                                     self._timeout)
        super().setup_distributed()
        placement.destroy_process_group_at_exit()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        report = self.global_rank == 0 and not self._reported  # once per strategy: validate/test/predict again
        self.topology, self.process_groups, self.placement = placement.start(
            self.options, self.world_size, self.global_rank, self.local_rank, self.num_processes, self.root_device,
            self._process_group_backend, report)
        self._reported = self._reported or report
        self._stop_heartbeat()  # a stage that ended without its teardown
        if self.world_size > 1 and self.options.process.heartbeat_timeout is not None:
            self.heartbeat = heartbeat.start(self.cluster_environment.main_address,
                                             self.cluster_environment.main_port, self.global_rank, self.placement,
                                             self.options.process.heartbeat_timeout)

    def _stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        # one process: the value itself, as SingleDeviceStrategy (an all-reduce over one rank costs ~0.2 ms a call)
        return tensor if self.world_size == 1 else super().reduce(tensor, group=group, reduce_op=reduce_op)

    def startup_table(self) -> str:
        """Topology, per-rank cores and threads, ISA, backend and allocator, as printed at fit start (after setup)."""
        return placement.startup_table(self.topology, self.placement, self._process_group_backend)

    # ------------------------------------------------------------------ the model, DDP and comm hooks

    @override
    def connect(self, model: Any) -> None:
        super().connect(model)
        if isinstance(self.precision_plugin, HorizonPrecision):  # the masters live where every part reads them
            self.precision_plugin.use_training_state(self.training_state)

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        trainer = getattr(self.lightning_module, "_trainer", None)
        if fit_parts.before_ddp(self, model, trainer, self._ddp_kwargs.get("find_unused_parameters", False)):
            return model  # no DDP wrapper: one process, or node-sharded (the owners' gradient path instead)
        return super()._setup_model(model)

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # with a store, trainer.init_module(empty_init=True) and configure_model (when fitting) declare the model on
        # the meta device, its init recorded: setup builds it into the store layer by layer (store/materialize.py)
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        fitting = trainer is not None and trainer.state.fn == "fit"
        if self.options.state_store is None or not (empty_init or (empty_init is None and fitting)):
            with super().tensor_init_context(empty_init):
                yield
        else:
            with super().tensor_init_context(False), deferred_init():
                yield

    @override
    def model_to_device(self) -> None:
        if not is_meta(self.model):  # declared on the meta device: the store builds it at setup, on the CPU
            super().model_to_device()

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # a model declared on the meta device has weights to load into only once setup built it in the store
        # (decided at the first ask, before setup, and kept for the fit: setup builds the module)
        if self._restore_after_setup is None:
            module = self.lightning_module
            self._restore_after_setup = self.options.state_store is not None and module is not None and is_meta(module)
        return super().restore_checkpoint_after_setup or self._restore_after_setup

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks on CUDA only and drops them silently on CPU; register on every device.
        if not isinstance(self.model, DistributedDataParallel):
            return  # node-sharded: the owners' gradient path instead
        state, hook = self._ddp_comm_state, self._ddp_comm_hook
        if hook is None:
            state, hook = fit_parts.comm_hook(self, self.model.module)
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self.model.register_comm_hook(state=state, hook=hook)

    @override
    def setup(self, trainer: Any) -> None:
        self.data_positions.setup_begins()  # a training loader made in here (configure_optimizers) predates the loop
        if self.world_size > 1:
            super().setup(trainer)
        else:
            # one process: the base Strategy's setup, without DDP's wrapper and DDPStrategy's broadcast of states
            Strategy.setup(self, trainer)
        self.data_positions.setup_ends()
        self.checkpoints.restore_node_weights(self.lightning_module)  # local SGD: this node's, from the checkpoint
        self.parts.connect(trainer, self.lightning_module, self.optimizers)
        fit_parts.at_setup(self, trainer)
        # last: nothing in setup draws from a restored generator (the sanity check runs under isolate_rng)
        self.parts.after_setup()

    # ------------------------------------------------------------------ the training data's position

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self.data_positions.process(super().process_dataloader(dataloader),
                                           getattr(self.lightning_module, "_trainer", None))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.data_positions.train_starts(self.lightning_module.trainer)

    # ------------------------------------------------------------------ training step, backward and optimizer step

    @override
    @heartbeat.beats("training_step", "after training_step")
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self.parts.before_training_step(self.lightning_module, batch, batch_idx,
                                        self.precision_plugin.train_step_context)
        output = super().training_step(*args, **kwargs)
        self.parts.after_training_step(output)
        if not self.lightning_module.automatic_optimization:
            # manual: the batch's steps (a GAN's two) once, after the last: local SGD averages what all stepped
            self.parts.after_optimizer_step()
        return output

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
    @heartbeat.beats(after="backward (the gradient allreduce)")
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        self.parts.pre_backward(self._sync_backward)

    @override
    @heartbeat.beats(before="after backward")
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        self.parts.post_backward()

    @override
    @heartbeat.beats("optimizer step", "after optimizer step")
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # the parts settle the gradients after the closure (forward, backward), before the optimizer reads them
        def settled() -> Any:
            out = closure()
            self.parts.gradients_ready()
            return out

        output = super().optimizer_step(optimizer, settled, model, **kwargs)
        self.parts.optimizer_stepped(optimizer)
        if self.lightning_module.automatic_optimization:
            self.parts.after_optimizer_step()  # manual optimization: once per batch, in training_step
        return output

    # ------------------------------------------------------------------ checkpoints (strategy_checkpoint.py)

    @override
    @heartbeat.beats("checkpoint write")
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self.checkpoints.before_write(checkpoint, filepath)  # every rank: the parts' per-rank state to rank 0
        super().save_checkpoint(self.data_positions.portable(checkpoint, CHECKPOINT_KEY), filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        self.checkpoints.after_remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        checkpoint = self.checkpoints.after_read(self.data_positions.restored(checkpoint, CHECKPOINT_KEY),
                                                 checkpoint_path)
        if self._restore_after_setup and self.model is not None:
            self.parts.after_setup()  # read after setup (a model the store built): the loaded states apply now
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(self.checkpoints.optimizer_states(checkpoint))

    # ------------------------------------------------------------------ the end

    @override
    def on_exception(self, exception: BaseException) -> None:
        Strategy.on_exception(self, exception)
        explain_unused(exception)  # DDPStrategy's explanation of the reducer's error, naming this strategy's switch
        liveness.name_lost_peer(exception, self.placement, self.global_rank, self._timeout.total_seconds())

    @override
    @heartbeat.beats("validation_step")
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().validation_step(*args, **kwargs)

    @override
    @heartbeat.beats("test_step")
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().test_step(*args, **kwargs)

    @override
    @heartbeat.beats("predict_step")
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().predict_step(*args, **kwargs)

    @override
    def teardown(self) -> None:
        self._restore_after_setup = None
        self._stop_heartbeat()
        self.parts.teardown()  # the sharder uninstalls: the module leaves fit exactly as it came in
        for name in fit_parts.FIT_ONLY:  # the weights are the module's own again: validate/test run replicated
            self.parts.remove(name)
        super().teardown()
        if self._thread_settings is not None:
            self._thread_settings.restore()
        if self.placement and self.placement[self.global_rank]["keeps_freed_memory"]:
            cpu.release_freed_memory()  # glibc's own thresholds again, the kept memory handed back

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # DDPStrategy's names: "horizon", "horizon_spawn", "horizon_fork", each also with
        # "_find_unused_parameters_true"; registering twice (the package imported again) is harmless
        for name, start_method in (("horizon", "popen"), ("horizon_spawn", "spawn"), ("horizon_fork", "fork")):
            for suffix, unused in (("", False), ("_find_unused_parameters_true", True)):
                if f"{name}{suffix}" not in strategy_registry:
                    strategy_registry.register(
                        f"{name}{suffix}", cls, start_method=start_method,
                        description=f"HorizonStrategy with start_method={start_method!r}"
                        f"{', find_unused_parameters=True' if unused else ''}",
                        **({"find_unused_parameters": True} if unused else {}))


__all__ = ["HorizonStrategy", "DEFAULT_TIMEOUT_S"]
