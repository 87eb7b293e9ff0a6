"""Graph sharding: activation recompute planned from the model's own graph to fit a memory budget."""

from lightning_horizon.sharding.budget import ShardingConfig, resolve_budget, resolve_sharding
from lightning_horizon.sharding.profile import Profile, profile_step

__all__ = ["ShardingConfig", "Profile", "profile_step", "resolve_budget", "resolve_sharding"]
