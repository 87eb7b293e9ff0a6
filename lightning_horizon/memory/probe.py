"""Memory probes: this process's resident set (now and its high-water mark) and what the node can still give.

The one implementation that the sharder (its budget and its per-step measurement), the fit check at setup and
``MemoryMonitor`` all read, so that the figures they log and act on are the same figures.

- RSS now: ``psutil``. The peak: ``VmHWM`` of ``/proc/self/status``, which :func:`reset_peak_rss` lowers to the
  current RSS (the sharder does, after every optimizer step, to measure each step on its own); ``ru_maxrss``
  where ``/proc`` is absent.
- Free memory on the node: the tighter of the cgroup limit (v2 ``memory.max``, or v1 ``memory.limit_in_bytes``,
  minus the cgroup's usage) and ``psutil.virtual_memory().available``: in a container the cgroup is the real wall.
  ``HORIZON_AVAILABLE_MEMORY`` (bytes) overrides it.
- A rank's fair share: its own RSS plus the free memory divided by the ranks on the node.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path
from typing import Optional

import psutil

from lightning_horizon import cpu
from lightning_horizon.checks import check_int

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge page-rounded number


def current_rss() -> int:
    """This process's resident set size now, in bytes."""
    return psutil.Process().memory_info().rss


def current_pss() -> int:
    """This process's proportional set size now, in bytes: its private pages plus its share of the pages it maps
    with other processes (the node's one copy of the weights under node-sharded state counts 1/L on each of its L
    ranks, where RSS counts it whole on each). Summed over a node's processes it is the node's memory."""
    pss = _proc_kib("/proc/self/smaps_rollup", "Pss:")
    return pss if pss is not None else current_rss()


def peak_rss() -> int:
    """This process's RSS high-water mark (since start or the last :func:`reset_peak_rss`), in bytes."""
    peak = _proc_kib("/proc/self/status", "VmHWM:")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # cannot be reset
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _proc_kib(path: str, key: str) -> Optional[int]:
    """The ``key: N kB`` line of a /proc file, in bytes (None where the file or the line is missing)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def cgroup_free() -> Optional[int]:
    """Bytes this process's cgroup may still allocate (the tightest limit up the tree), or None if unlimited."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    best: Optional[int] = None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # cgroup v2: memory.max / memory.current
            base, limit_file, usage_file = _CGROUP_ROOT, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # cgroup v1
            base, limit_file, usage_file = _CGROUP_ROOT / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        # Inside a container the path in /proc/self/cgroup may not exist under the mounted root (the cgroup
        # namespace hides it): walk up from the named path, then fall back to the mount root.
        path = base / rel.lstrip("/")
        candidates = [path, *path.parents] if path.is_relative_to(base) else [base]
        for d in candidates:
            if not d.is_relative_to(base):
                break
            limit = _read_int(d / limit_file)
            if limit is not None:
                usage = _read_int(d / usage_file) or 0
                free = max(0, limit - usage)
                best = free if best is None else min(best, free)
    return best


#: Environment variable that overrides the node's free memory as :func:`node_free_memory` sees it, in bytes: for
#: a node whose real limit the probe cannot see (a container without its cgroup mounted, memory promised to other
#: jobs), and for tests, which lower it to put a run under memory pressure without exhausting anything.
AVAILABLE_MEMORY_ENV = "HORIZON_AVAILABLE_MEMORY"


def node_free_memory() -> int:
    """Bytes the node can still give: the tighter of the cgroup's room and the kernel's available memory, or
    ``HORIZON_AVAILABLE_MEMORY`` when it is set."""
    override = os.environ.get(AVAILABLE_MEMORY_ENV)
    if override is not None:
        value = int(override) if override.strip().isdigit() else -1
        if value < 0:
            raise ValueError(f"{AVAILABLE_MEMORY_ENV}={override!r}: must be an int >= 0 (bytes free on the node)")
        return value
    free = psutil.virtual_memory().available
    limit = cgroup_free()
    return free if limit is None else min(free, limit)


def fair_share(local_world_size: int = 1) -> int:
    """This rank's share of the node: its own RSS plus the free memory divided by the ranks on the node."""
    check_int("fair_share", "local_world_size", local_world_size, 1)
    return current_rss() + node_free_memory() // local_world_size


#: Prior for glibc malloc with default settings (see ``ShardingConfig.allocator_overhead``).
GLIBC_OVERHEAD = 2.0
GLIBC_HINT = (
    f"glibc malloc keeps freed activations resident: the first plan assumes {GLIBC_OVERHEAD}x the live tensors and"
    " later steps measure it (the settings that avoid it: docs/sharding.md#the-allocator-decides-what-rss-means)"
)


def returns_freed_memory() -> bool:
    """True when the allocator returns or reuses freed memory well: jemalloc/tcmalloc, or glibc told to mmap
    large blocks at a fixed threshold (which also stops it from raising the threshold as it goes)."""
    if cpu.allocator() is not None:  # the allocator probe lives with the other CPU facts
        return True
    return "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "") or "MALLOC_MMAP_THRESHOLD_" in os.environ


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, three significant figures)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"


__all__ = [
    "AVAILABLE_MEMORY_ENV",
    "GLIBC_HINT",
    "GLIBC_OVERHEAD",
    "cgroup_free",
    "current_pss",
    "current_rss",
    "fair_share",
    "fmt_bytes",
    "node_free_memory",
    "peak_rss",
    "reset_peak_rss",
    "returns_freed_memory",
]
