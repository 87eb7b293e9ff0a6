"""Graph sharding: activation recompute planned from the model's own graph to fit a memory budget.

``GraphSharder`` ties the parts together: ``config`` (``ShardingConfig``, and how much memory this rank may use),
``profile`` (one pass over training_step: what each module call saves and costs), ``plan`` (which calls to
recompute: a DP over the call sequence; ``shard_plan``, what it returns) and ``executor`` (checkpointing installed on instances' ``forward``).
"""

from lightning_horizon.sharding.config import ShardingConfig, resolve_budget, resolve_sharding
from lightning_horizon.sharding.executor import Installed, install
from lightning_horizon.sharding.plan import InfeasibleBudgetError, ShardPlan, evaluate, make_plan
from lightning_horizon.sharding.profile import Profile, profile_step
from lightning_horizon.sharding.sharder import GraphSharder

__all__ = [
    "GraphSharder",
    "InfeasibleBudgetError",
    "Installed",
    "Profile",
    "ShardPlan",
    "ShardingConfig",
    "evaluate",
    "install",
    "make_plan",
    "profile_step",
    "resolve_budget",
    "resolve_sharding",
]
