"""HorizonStrategy's own options, checked and resolved in the Trainer's constructor (strategy_args.py has the
checks): before a launcher starts a process or a group. The parts are built from these (fit_parts.py)."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Union

from lightning_horizon.collectives import CollectivesConfig
from lightning_horizon.sharding import ShardingConfig, resolve_sharding
from lightning_horizon.store import StoreConfig, resolve_store
from lightning_horizon.strategy_args import check_arguments, check_heartbeat, check_state


@dataclass(frozen=True)
class HorizonOptions:
    """What HorizonStrategy was asked for, every value checked (the strategy's docstring says what each means)."""

    ranks_per_node: Optional[int]
    bucket_size_mb: float
    timeout: timedelta
    process_group_backend: Optional[str]
    pin_cores: bool
    threads_per_rank: Optional[int]
    keep_freed_memory: bool
    sharding: Optional[ShardingConfig]
    collectives: CollectivesConfig
    state: str
    node_weights: str
    state_checkpoint: str
    shard_group_nodes: Union[str, int]
    store: Optional[StoreConfig]
    heartbeat_timeout: Optional[float]

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_size_mb * 2**20)

    @classmethod
    def resolve(
        cls, *, ranks_per_node: Any, bucket_size_mb: Any, timeout: Any, process_group_backend: Any, pin_cores: Any,
        threads_per_rank: Any, keep_freed_memory: Any, sharding: Any, collectives: Any, compression: Any,
        sync_every: Any, sync_warmup_steps: Any, outer: Any, outer_lr: Any, outer_momentum: Any, sync_overlap: Any,
        torus_shape: Any, cost_model: Any, state: Any, node_weights: Any,
        state_checkpoint: Any, shard_group_nodes: Any, state_store: Union[None, str, os.PathLike, StoreConfig],
        checkpoint_io: Any, heartbeat_timeout: Any, ddp_kwargs: dict[str, Any], named: set[str],
    ) -> "HorizonOptions":
        """Check every argument (ValueError naming the first bad one) and resolve the configs. ``ddp_kwargs``: the
        extra keywords for DDPStrategy and DistributedDataParallel; ``named``: the strategy's own parameter names."""
        resolved_sharding = resolve_sharding(sharding)
        config = CollectivesConfig(collectives=collectives, compression=compression, sync_every=sync_every,
                                   sync_warmup_steps=sync_warmup_steps, outer=outer, outer_lr=outer_lr,
                                   outer_momentum=outer_momentum, sync_overlap=sync_overlap, torus_shape=torus_shape,
                                   cost_model=cost_model)
        check_state(state, node_weights, state_checkpoint, shard_group_nodes, collectives, compression, sync_every,
                    ddp_kwargs.get("ddp_comm_hook"))
        store = resolve_store(state_store)
        if store is not None and state != "replicated":
            raise ValueError(f"state_store={state_store!r} with state={state!r}: the out-of-core store holds a whole"
                             " replica per rank; use state='replicated' (the default) with it")
        seconds = check_arguments(
            ranks_per_node=ranks_per_node, bucket_size_mb=bucket_size_mb, timeout=timeout,
            process_group_backend=process_group_backend, pin_cores=pin_cores, threads_per_rank=threads_per_rank,
            keep_freed_memory=keep_freed_memory, checkpoint_io=checkpoint_io, collectives_changed=config.changed(),
            kwargs=ddp_kwargs, named=named,
        )
        return cls(ranks_per_node=ranks_per_node, bucket_size_mb=bucket_size_mb, timeout=timedelta(seconds=seconds),
                   process_group_backend=process_group_backend, pin_cores=pin_cores,
                   threads_per_rank=threads_per_rank, keep_freed_memory=keep_freed_memory,
                   sharding=resolved_sharding, collectives=config, state=state, node_weights=node_weights,
                   state_checkpoint=state_checkpoint,
                   shard_group_nodes=shard_group_nodes, store=store,
                   heartbeat_timeout=check_heartbeat(heartbeat_timeout))


#: the strategy's arguments that :meth:`HorizonOptions.resolve` takes by the same names (its signature, less what
#: the strategy gathers itself)
ARGUMENTS = tuple(n for n in inspect.signature(HorizonOptions.resolve).parameters if n not in ("ddp_kwargs", "named"))

__all__ = ["ARGUMENTS", "HorizonOptions"]
