"""Memory: probes (RSS, its peak, the node's free memory), estimates (what training will still allocate) and the
fit check at setup. One implementation, read by the sharder, the strategy and ``MemoryMonitor`` alike."""

from lightning_horizon.memory.check import InsufficientMemoryError, check_fit, rank_row, training_memory
from lightning_horizon.memory.estimate import bytes_per_param, gradients_pending, held_bytes, optimizer_state_pending
from lightning_horizon.memory.probe import (
    AVAILABLE_MEMORY_ENV,
    GLIBC_HINT,
    GLIBC_OVERHEAD,
    cgroup_free,
    current_pss,
    current_rss,
    fair_share,
    fmt_bytes,
    node_free_memory,
    peak_rss,
    reset_peak_rss,
    returns_freed_memory,
)

__all__ = [
    "AVAILABLE_MEMORY_ENV",
    "GLIBC_HINT",
    "GLIBC_OVERHEAD",
    "InsufficientMemoryError",
    "bytes_per_param",
    "cgroup_free",
    "check_fit",
    "current_pss",
    "current_rss",
    "fair_share",
    "fmt_bytes",
    "gradients_pending",
    "held_bytes",
    "node_free_memory",
    "optimizer_state_pending",
    "peak_rss",
    "rank_row",
    "reset_peak_rss",
    "returns_freed_memory",
    "training_memory",
]
