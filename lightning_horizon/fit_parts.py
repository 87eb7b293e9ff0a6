"""The plan of parts: which parts a fit is made of, when each is born, and the capabilities' checkpoint steps.
HorizonStrategy calls these functions at the points of Lightning's lifecycle named below and loops over its parts
everywhere else; besides, it names parts only in its read-only accessors (``sharder``, ``gradient_sync``, ``store``,
``node_state``, ``node_shares``). Where one part reads what another changes, the reader declares it
(``Part.runs_before``) and the registry keeps the order: the store ahead of the sharder, whose measured peak its
step hook reads.

0. the constructor (:func:`at_construction`): ``rng`` (per-rank RNG state, exact resume).
1. ``_setup_model``, before DDP, the optimizers and the precision plugin connect (:func:`before_ddp`):
   ``embedding`` (the module holds a ``ShardedEmbeddingBag``: each rank keeps its rows, out of DDP; placed last, once
   the parts below are known not to be refused), ``store`` (``state_store=``, fitting only: masters and optimizer
   state are born in the store), then with one process ``unused`` (the module stays unwrapped; after the first step
   it names the parameters that got no gradient, which DDP refuses on several), else ``node_state``
   (``state="node_sharded"`` with several ranks per node: the weights move into the node's shared memory and the
   gradients take the owners' path, so the model is not wrapped in DDP).
2. ``_register_ddp_hooks`` (:func:`comm_hook`): ``collectives``, the comm hook's state, unless one rank runs or
   the user registered a hook of their own.
3. the end of ``setup`` (:func:`at_setup`): the memory check, then ``sharding`` (planned at the first
   ``training_step``).

The fit-only parts (:data:`FIT_ONLY`) leave the registry at teardown: validate, test and predict run replicated.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_horizon import memory, placement
from lightning_horizon.collectives import CostModel, GradientSync
from lightning_horizon.collectives.probe import probe
from lightning_horizon.embedding import EmbeddingTables, table_groups, tables_of
from lightning_horizon.collectives.local_sgd import NodeWeightsCheckpoint
from lightning_horizon.node_state import NodeState, resolve_group_nodes
from lightning_horizon.node_state.checkpoint import NodeShardedCheckpoint
from lightning_horizon.parts import CheckpointStep, Parts
from lightning_horizon.rng import RNGState
from lightning_horizon.sharding import GraphSharder
from lightning_horizon.checkpoint_io import AtomicCheckpointIO
from lightning_horizon.store import OutOfCore, StreamedCheckpointIO, store_folder
from lightning_horizon.unused import UnusedParameters

log = logging.getLogger("lightning_horizon.strategy")

#: parts that exist for one fit only
FIT_ONLY = ("node_state", "store")


def at_construction() -> Parts:
    """The registry with the parts born with the strategy (0. above)."""
    parts = Parts()
    parts.add("rng", RNGState())
    return parts


def checkpoint_steps() -> tuple[CheckpointStep, ...]:
    """What the capabilities add to the strategy's checkpoints beyond their parts' state, in the order they run:
    node-sharded state's shares, local SGD's node weights (parts.CheckpointStep)."""
    return NodeShardedCheckpoint(), NodeWeightsCheckpoint()


def before_ddp(strategy: Any, model: nn.Module, trainer: Any, find_unused: bool) -> bool:
    """Add the parts born before DDP (1. above); True when the module stays unwrapped: one process (nothing to
    synchronize), or node-sharded state in DDP's place. ``find_unused``: DDP's ``find_unused_parameters``."""
    tables = add_tables(strategy, model) if tables_of(model) else None
    unwrapped = _state_parts(strategy, model, trainer, find_unused)
    if tables is not None:  # last: a part refused above has moved nothing
        tables.place(model)
    return unwrapped


def _state_parts(strategy: Any, model: nn.Module, trainer: Any, find_unused: bool) -> bool:
    options = strategy.options
    if options.state_store is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
        part = OutOfCore(options.state_store, strategy.training_state, strategy.global_rank, lambda: strategy.sharder,
                         budgeted=options.sharding is not None,
                         budget_bytes=options.sharding.budget_bytes if options.sharding is not None else None)
        strategy.parts.refuse_taken("store", part)
        part.install(model, store_folder(options.state_store, trainer))
        strategy.parts.add("store", part)
        if type(strategy.checkpoint_io) is AtomicCheckpointIO:  # saves write back as they go (store/checkpoint.py)
            strategy.checkpoint_io = StreamedCheckpointIO()
    if strategy.world_size == 1:
        if not find_unused:  # a parameter that gets no gradient fails DDP on several processes: warn of it
            strategy.parts.add("unused", UnusedParameters(model))
        return True
    if not options.node_state.sharded:
        return False
    group_nodes = resolve_group_nodes(options.node_state.shard_group_nodes, strategy.topology.num_nodes)
    if strategy.topology.ranks_per_node == 1 and group_nodes == 1:
        if strategy.global_rank == 0:
            log.info("HorizonStrategy(state='node_sharded'): one rank per node and one node per shard group holds"
                     " everything; replicated")
        return False
    # Before the optimizers and the precision plugin connect: masters only for what this rank owns.
    node = NodeState(model, strategy.process_groups, options.process.bucket_bytes, strategy.training_state,
                     strategy.precision_plugin, options.node_state.node_weights, group_nodes)
    strategy.parts.refuse_taken("node_state", node)
    node.install()
    strategy.parts.add("node_state", node)
    return True


def add_tables(strategy: Any, model: nn.Module) -> EmbeddingTables:
    """The sharded embedding tables' part, placed by :func:`before_ddp` once the other parts are known (collective: a
    process group of the tables' own, made by every rank at the same point, once per strategy)."""
    if strategy.nodes_diverge:
        raise ValueError(
            f"ShardedEmbeddingBag with HorizonStrategy(sync_every={strategy.options.collectives.sync_every}) on"
            f" {strategy.topology.num_nodes} nodes: local SGD averages each rank's parameters with its peers on the"
            " other nodes, which hold other rows of the table; use sync_every=1")
    old = strategy.parts.last("embedding")
    groups = old.groups if old is not None else table_groups(strategy.topology)
    tables = EmbeddingTables(model, strategy.training_state, strategy.topology, groups, lambda: links(strategy))
    strategy.parts.add("embedding", tables)
    return tables


def links(strategy: Any) -> CostModel:
    """The link constants: the strategy's ``cost_model``, or the probe's (collective: every rank calls it)."""
    given = strategy.options.collectives.cost_model
    return given if given is not None else probe(strategy.process_groups, ())


def comm_hook(strategy: Any, module: nn.Module) -> tuple[GradientSync, Callable[..., Any]]:
    """The comm hook and its state (2. above). Built on every rank at the same point: it may create grid groups and
    probe the links (collective)."""
    sync = GradientSync.with_links(strategy.options.collectives, strategy.process_groups, module,
                                   strategy.training_state)
    strategy.parts.add("collectives", sync)
    return sync, sync.hook


def at_setup(strategy: Any, trainer: Any) -> None:
    """The end of setup (3. above): the memory check when fitting, then the graph sharder."""
    options = strategy.options
    if strategy.store is None and trainer.state.fn == TrainerFn.FITTING:
        # sharding shrinks activations, not what this checks; the store checked its disk
        check_memory(strategy)
    if options.sharding is not None and "sharding" not in strategy.parts:
        # Plans at the first training_step (the first batch is what it profiles); all ranks of the node share its
        # memory. Recompute runs in backward, outside training_step's precision context: the plugin re-establishes it.
        strategy.parts.add("sharding", GraphSharder(
            options.sharding, strategy.num_processes, rank=strategy.global_rank,
            recompute_context=getattr(strategy.precision_plugin, "recompute_context", None),
            state_in_memory=strategy.store is None,
        ))


def check_memory(strategy: Any) -> None:
    """Fail at setup, on every rank, when gradients and optimizer state cannot fit, or a sharding budget in bytes is
    more than the rank can have (see memory/check.py)."""
    topology, node, sharding = strategy.topology, strategy.node_state, strategy.options.sharding
    # a sharded table's rows get no dense gradient or optimizer state: its own sparse state instead
    tables = strategy.training_state.sparse_tables()
    sparse = {id(t.weight) for t in tables}
    owns = node.owns if node is not None else None
    if sparse:
        owns = lambda p, held=owns: id(p) not in sparse and (held is None or held(p))  # noqa: E731
    need = memory.training_memory(
        strategy.lightning_module, strategy.optimizers, strategy.precision_plugin, owns=owns,
        weights_shared_by=topology.ranks_per_node if node is not None and node.weights_mode == "shared" else 1,
    )
    tables_state = sum(t.optimizer_state_bytes() for t in tables)
    need["optimizer_state"] += tables_state
    need["pending"] += tables_state
    row = memory.rank_row(strategy.global_rank, topology.node_rank, strategy.num_processes, need,
                          sharding=sharding is not None, budget=sharding.budget_bytes if sharding else None)
    memory.check_fit(placement.all_gather_objects(row))  # every rank decides alike: none is left waiting


__all__ = ["FIT_ONLY", "add_tables", "at_construction", "at_setup", "before_ddp", "check_memory", "checkpoint_steps",
           "comm_hook"]
