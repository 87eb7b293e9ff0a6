"""HorizonStrategy's options: one frozen config per group, each declaring, documenting and checking its own fields
(process_config.py, collectives/config.py, node_state/config.py, sharding/config.py, store/config.py), and here the
rules between groups, each once. Every keyword of the strategy is a field of exactly one of these configs, of the
same name (:func:`keywords`); all of it is checked in the Trainer's constructor, before a launcher starts a process
or a group, and what needs the world size before the launcher starts the ranks (:meth:`HorizonOptions.check_world`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from lightning_horizon.checks import check_one_of
from lightning_horizon.collectives import CollectivesConfig
from lightning_horizon.node_state.config import NodeStateConfig
from lightning_horizon.process_config import OWNER, ProcessConfig
from lightning_horizon.sharding import ShardingConfig, resolve_sharding
from lightning_horizon.store import StoreConfig, resolve_store

#: the collectives a node-sharded run accepts: its gradient path (node_state/reduce.py) is always two-level
NODE_SHARDED_COLLECTIVES = ("flat", "hierarchical", "auto")
START_METHODS = ("popen", "spawn", "fork", "forkserver")
#: the configs whose fields are the strategy's keywords of the same names
GROUPS = (ProcessConfig, CollectivesConfig, NodeStateConfig)
#: the keywords that are whole configs (or what the config is made from), not a group's field
WHOLE = ("sharding", "state_store")


def keywords() -> tuple[str, ...]:
    """The strategy's own keywords: every group's fields (but a field marked ``metadata={"keyword": False}``, a
    config's knob not offered by the strategy) and the whole configs."""
    return (*(f.name for g in GROUPS for f in fields(g) if f.metadata.get("keyword", True)), *WHOLE)


@dataclass(frozen=True)
class HorizonOptions:
    """What HorizonStrategy was asked for, every value checked (each config's docstrings say what it means)."""

    process: ProcessConfig = field(default_factory=ProcessConfig)
    collectives: CollectivesConfig = field(default_factory=CollectivesConfig)
    node_state: NodeStateConfig = field(default_factory=NodeStateConfig)
    #: ``None``, ``"auto"`` or a ``ShardingConfig`` as given; a ``ShardingConfig`` or ``None`` once checked
    sharding: Optional[ShardingConfig] = None
    #: ``None``, ``"auto"``, a folder or a ``StoreConfig`` as given; a ``StoreConfig`` or ``None`` once checked
    state_store: Optional[StoreConfig] = None
    #: the extra keywords for DDPStrategy and DistributedDataParallel
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding", resolve_sharding(self.sharding))
        given_store = self.state_store
        object.__setattr__(self, "state_store", resolve_store(given_store))
        state, c, hook = self.node_state.state, self.collectives, self.ddp_kwargs.get("ddp_comm_hook")
        if self.node_state.sharded:
            _refuse_with_node_sharded(c, hook)
        if self.state_store is not None and state != "replicated":
            raise ValueError(f"state_store={given_store!r} with state={state!r}: the out-of-core store holds a whole"
                             " replica per rank; use state='replicated' (the default) with it")
        changed = c.changed()
        if hook is not None and changed:
            raise ValueError(f"ddp_comm_hook={hook!r} with {', '.join(changed)}: give either your own hook or the"
                             " collectives options, not both")
        _check_ddp_kwargs(self.ddp_kwargs)

    def check_world(self, world: int, ranks_here: int, device: torch.device) -> None:
        """What the world size decides, checked before the launcher starts any process: ``ranks_per_node`` divides
        it, ``shard_group_nodes`` divides the number of nodes, the backend reduces ``device``'s tensors, the torus
        grid fits and, with compression, has a stage to compress."""
        self.process.check_world(world, device)
        per_node = self.process.ranks_per_node or ranks_here
        self.node_state.check_nodes(world // per_node)
        self.collectives.check_world(world, per_node)


def _refuse_with_node_sharded(c: CollectivesConfig, ddp_comm_hook: Any) -> None:
    """What ``state="node_sharded"`` does not implement, refused by name."""
    why = "node_sharded reduces each gradient bucket to its owner in the node, then across nodes among owners"
    if c.collectives not in NODE_SHARDED_COLLECTIVES:
        raise ValueError(f"collectives={c.collectives!r} with state='node_sharded': not supported ({why}); allowed:"
                         f" {', '.join(map(repr, NODE_SHARDED_COLLECTIVES))}, or state='replicated'")
    if c.compression is not None:
        raise ValueError(f"compression={c.compression!r} with state='node_sharded': not supported ({why},"
                         " uncompressed); use compression=None, or state='replicated'")
    if c.sync_every != 1:
        raise ValueError(f"sync_every={c.sync_every!r} with state='node_sharded': not supported (local SGD averages"
                         " every rank's whole weights); use sync_every=1, or state='replicated'")
    if ddp_comm_hook is not None:
        raise ValueError(f"ddp_comm_hook={ddp_comm_hook!r} with state='node_sharded': the node-sharded gradient path"
                         " replaces DDP's; use state='replicated' for a hook of your own")


def _check_ddp_kwargs(kwargs: dict[str, Any]) -> None:
    """The keywords handed on to DDPStrategy and DistributedDataParallel, checked by name: a misspelt one would
    otherwise fail in DDP's constructor, after every process has started."""
    if "bucket_cap_mb" in kwargs:
        raise ValueError(f"bucket_cap_mb={kwargs['bucket_cap_mb']!r}: not accepted; pass bucket_size_mb= (same"
                         " meaning, MiB > 0)")
    if "start_method" in kwargs:
        check_one_of(OWNER, "start_method", kwargs["start_method"], START_METHODS)
    # DDP's own parameter lists (Lightning's and torch's): the names an extra keyword may have
    known = set(inspect.signature(DDPStrategy.__init__).parameters)
    known |= set(inspect.signature(DistributedDataParallel.__init__).parameters)
    known -= set(keywords())  # the strategy's own parameters are never extra keywords
    known -= {"self", "kwargs", "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
              "precision_plugin", "module", "device_ids", "bucket_cap_mb"}  # the strategy takes or passes these
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"{unknown[0]}={kwargs[unknown[0]]!r}: not a HorizonStrategy, DDPStrategy or DistributedDataParallel"
            f" argument; allowed extra keywords are {sorted(known)}"
        )


__all__ = ["GROUPS", "HorizonOptions", "NODE_SHARDED_COLLECTIVES", "START_METHODS", "keywords"]
