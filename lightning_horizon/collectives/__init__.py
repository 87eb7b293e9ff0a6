"""Topology-aware gradient allreduce for DDP on CPU clusters: flat, hierarchical, 2D torus, cost-model ``auto``,
bf16/int8 compression with error feedback, hierarchical local SGD, and per-step communication accounting.

See docs/collectives.md for each algorithm's steps, cost and when to choose it.
"""

from lightning_horizon.collectives.accounting import CommAccounting, Counters
from lightning_horizon.collectives.config import ALGORITHMS, COMPRESSIONS, CollectivesConfig
from lightning_horizon.collectives.cost_model import CostModel, Link, Prediction
from lightning_horizon.collectives.sync import (
    HOOKS,
    GradientSync,
    auto_hook,
    flat_hook,
    hierarchical_hook,
    local_sgd_hook,
    needs_links,
    sync_links,
    torus2d_hook,
)

__all__ = [
    "ALGORITHMS",
    "COMPRESSIONS",
    "HOOKS",
    "CollectivesConfig",
    "CommAccounting",
    "CostModel",
    "Counters",
    "GradientSync",
    "Link",
    "Prediction",
    "auto_hook",
    "flat_hook",
    "hierarchical_hook",
    "local_sgd_hook",
    "needs_links",
    "sync_links",
    "torus2d_hook",
]
