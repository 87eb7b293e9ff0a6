"""HorizonStrategy: Lightning's DDP, made for CPU machines and CPU clusters.

DDPStrategy's whole lifecycle, on processes made for CPUs (strategy_processes.py: backend, cores, topology, timeout,
heartbeat), with comm hooks really registered on CPU and the parts (parts.py) a fit is made of (fit_parts.py), each
keeping its per-rank state under one checkpoint key (strategy_checkpoint.py).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Generator, Optional, Union

import torch
from torch.nn.parallel import DistributedDataParallel
from lightning.pytorch.strategies.strategy import Strategy
from typing_extensions import override

from lightning_horizon import fit_parts, heartbeat
from lightning_horizon.collectives import CollectivesConfig
from lightning_horizon.data_position import DataPositions
from lightning_horizon.checkpoint_io import or_atomic
from lightning_horizon.parts import Parts, part
from lightning_horizon.precision import HorizonPrecision
from lightning_horizon.state import TrainingState
from lightning_horizon.sharding import ShardingConfig
from lightning_horizon.node_state import NodeState
from lightning_horizon.node_state.config import NodeStateConfig
from lightning_horizon.options import HorizonOptions
from lightning_horizon.process_config import DEFAULT_TIMEOUT_S, ProcessConfig
from lightning_horizon.strategy_checkpoint import StrategyCheckpoint
from lightning_horizon.strategy_processes import CPUProcessesStrategy
from lightning_horizon.store import StoreConfig
from lightning_horizon.store.materialize import deferred_init, is_meta

class HorizonStrategy(CPUProcessesStrategy):
    """Multi-process data-parallel training on CPUs, topology-aware (docs/strategy.md). Every keyword is the field
    of the same name of one config, which documents and checks it (options.py: ``ProcessConfig``,
    ``CollectivesConfig``, ``NodeStateConfig``; ``sharding``: a ``ShardingConfig``, ``state_store``: a
    ``StoreConfig``). ``ddp_comm_state``, ``ddp_comm_hook``, ``ddp_comm_wrapper``: a DDP comm hook of your own,
    registered on CPU too; other keywords go to ``DDPStrategy`` and ``DistributedDataParallel``."""

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
        # each group checked by its config, then the rules between them: before a launcher starts any process
        options = HorizonOptions(
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
            options, accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=or_atomic(checkpoint_io),
            precision_plugin=precision_plugin, process_group_backend=process_group_backend,
            timeout=options.process.timeout, bucket_cap_mb=bucket_size_mb, **kwargs,
        )
        #: the owner of the true weights (state.py), one per strategy: handed to the precision plugin and every part
        self.training_state = TrainingState()
        #: the parts (parts.py), built by fit_parts.py; their per-rank state is kept under one checkpoint key
        self.parts: Parts = fit_parts.at_construction()
        #: the checkpoint side (strategy_checkpoint.py): what a save adds, what a load hands back
        self.checkpoints = StrategyCheckpoint(self, fit_parts.checkpoint_steps())
        #: the training data's position (data_position.py): loaders that resume mid-epoch, into any world size
        self.data_positions = DataPositions()
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

    # ------------------------------------------------------------------ the model, DDP, comm hooks and the data

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
        self.checkpoints.after_setup()  # e.g. local SGD: this node's weights, from the checkpoint
        self.parts.connect(trainer, self.lightning_module, self.optimizers)
        fit_parts.at_setup(self, trainer)
        # last: nothing in setup draws from a restored generator (the sanity check runs under isolate_rng)
        self.parts.after_setup()

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
        # every rank: the parts' per-rank state to rank 0, which writes
        super().save_checkpoint(self.checkpoints.before_write(checkpoint, filepath), filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        self.checkpoints.after_remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = self.checkpoints.after_read(super().load_checkpoint(checkpoint_path, weights_only=weights_only),
                                                 checkpoint_path)
        if self._restore_after_setup and self.model is not None:
            self.parts.after_setup()  # read after setup (a model the store built): the loaded states apply now
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(self.checkpoints.optimizer_states(checkpoint))

    @override
    def teardown(self) -> None:
        self._restore_after_setup = None
        self._stop_heartbeat()  # first: the parts' teardown is no step of the training's
        self.parts.teardown()  # the sharder uninstalls: the module leaves fit exactly as it came in
        self.parts.remove(*fit_parts.FIT_ONLY)  # the weights are the module's own again: validate/test replicated
        super().teardown()


__all__ = ["HorizonStrategy", "DEFAULT_TIMEOUT_S"]
