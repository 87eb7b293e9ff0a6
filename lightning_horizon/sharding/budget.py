"""How much memory this rank may use, and the configuration of graph sharding.

The budget is a whole-process figure (resident set size): the planner subtracts what is already resident
(weights, gradients, optimizer state, the Python heap) and plans the activations into what is left. Where the
budget comes from, in order of precedence:

1. ``ShardingConfig(budget=<int>)``: that many bytes for this rank.
2. ``ShardingConfig(budget=<float in (0, 1]>)``: that fraction of this rank's fair share of the node.
3. ``ShardingConfig(budget=None)`` / ``sharding="auto"``: ``auto_fraction`` of the fair share.

The fair share is this rank's own RSS plus the node's free memory divided by the ranks on the node. Free
memory is the tighter of the cgroup limit (v2 ``memory.max``, or v1 ``memory.limit_in_bytes``, minus the
cgroup's usage) and ``psutil.virtual_memory().available``: in a container the cgroup is the real wall.
``HORIZON_AVAILABLE_MEMORY`` (bytes) overrides it. Budgets 2 and 3 follow the free memory during training.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional, Union

import psutil

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge page-rounded number


@dataclass
class ShardingConfig:
    """Graph sharding: activation recompute planned to fit a memory budget, and re-planned from measurement."""

    budget: Optional[Union[int, float]] = None
    """Memory for this rank, whole process (RSS). An ``int`` is bytes; a ``float`` in (0, 1] is a fraction of
    this rank's fair share of the node; ``None`` means ``auto_fraction`` of that share."""

    auto_fraction: float = 0.9
    """Fraction of the fair share used when ``budget`` is ``None``: the rest is left to the OS, page cache and
    allocator slack that RSS accounting does not see coming."""

    headroom: float = 0.95
    """A plan that recomputes aims at ``headroom * budget``; a step whose measured peak RSS exceeds it triggers a
    re-plan with more recompute at the next step boundary. A step that fits the budget whole is not recomputed at
    all, and is re-planned only when its measured peak exceeds the budget by more than the same margin
    (``(1 - headroom) * budget``: run-to-run noise of the plain step's peak is not worth recomputing for)."""

    adaptive: bool = True
    """Measure peak RSS after every optimizer step and re-plan (tighter above ``headroom``, looser when far
    under budget). ``False`` keeps the first plan for the whole run."""

    relax_below: float = 0.7
    """A step is "far under budget" when its peak RSS is below ``relax_below * budget``."""

    relax_after: int = 50
    """Consecutive far-under-budget steps before the plan is relaxed (less recompute). Large enough that one
    short sequence batch does not undo a plan that the long ones need."""

    allocator_overhead: Optional[float] = None
    """Resident bytes per live activation byte expected on the first step (later steps measure it and re-plan).
    ``None``: 1.0 where freed memory is returned or reused well (jemalloc, tcmalloc, glibc with a fixed
    ``mmap_threshold``), else ``GLIBC_OVERHEAD``: glibc's default raises its mmap threshold as it goes and
    keeps freed activations resident, measured at 1.8-2.4x the live bytes on GPT steps here."""

    profile: str = "auto"
    """How the profiling pass runs ``training_step``: ``"fake"`` (FakeTensor: no real memory, no compute),
    ``"real"`` (a slice of the real batch, figures scaled up), or ``"auto"`` (fake, falling back to real when
    the step is data-dependent or an op has no fake implementation)."""

    profile_batch_fraction: float = 0.25
    """Fraction of the batch (leading dimension, at least one sample) that a real profiling pass runs; its
    byte and FLOP counts are scaled back up by the inverse."""

    def __post_init__(self) -> None:
        b = self.budget
        if b is not None:
            if isinstance(b, bool) or not isinstance(b, (int, float)):
                raise ValueError(f"budget={b!r}: must be an int (bytes), a float in (0, 1] (fraction) or None (auto)")
            if not b > 0:  # NaN too
                raise ValueError(f"budget={b!r}: must be > 0 (bytes as an int, or a fraction in (0, 1])")
            if isinstance(b, float) and b > 1:
                raise ValueError(
                    f"budget={b!r}: a float is a fraction of this rank's memory and must be in (0, 1];"
                    f" for bytes pass an int, e.g. budget={int(b)}"
                )
        _check_fraction("auto_fraction", self.auto_fraction)
        _check_fraction("headroom", self.headroom)
        _check_fraction("relax_below", self.relax_below)
        _check_fraction("profile_batch_fraction", self.profile_batch_fraction)
        if self.relax_below >= self.headroom:
            raise ValueError(
                f"relax_below={self.relax_below!r}: must be below headroom={self.headroom!r}, or the plan would"
                " tighten and relax on the same measurement"
            )
        if isinstance(self.relax_after, bool) or not isinstance(self.relax_after, int) or self.relax_after < 1:
            raise ValueError(f"relax_after={self.relax_after!r}: must be an int >= 1 (steps)")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive={self.adaptive!r}: must be True or False")
        if self.allocator_overhead is not None and (
            isinstance(self.allocator_overhead, bool)
            or not isinstance(self.allocator_overhead, (int, float))
            or not 1 <= self.allocator_overhead <= 10
        ):
            raise ValueError(f"allocator_overhead={self.allocator_overhead!r}: must be None (auto) or in [1, 10]")
        if self.profile not in ("auto", "fake", "real"):
            raise ValueError(f"profile={self.profile!r}: allowed are 'auto', 'fake', 'real'")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_fraction(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name}={value!r}: must be a number in (0, 1]")


def resolve_sharding(sharding: object) -> Optional[ShardingConfig]:
    """Validate the strategy's ``sharding=`` argument: ``None`` (off), ``"auto"`` or a ``ShardingConfig``."""
    if sharding is None:
        return None
    if isinstance(sharding, str) and sharding == "auto":
        return ShardingConfig()
    if isinstance(sharding, ShardingConfig):
        return sharding
    hint = ""
    if isinstance(sharding, (int, float)) and not isinstance(sharding, bool):
        hint = f"; for a memory budget write sharding=ShardingConfig(budget={sharding!r})"
    raise ValueError(f"sharding={sharding!r}: allowed are None, 'auto' or a ShardingConfig(...){hint}")


# ---------------------------------------------------------------------------------------------- memory probes


def current_rss() -> int:
    """This process's resident set size now, in bytes."""
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    """This process's RSS high-water mark (since start or the last :func:`reset_peak_rss`), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB; cannot be reset


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
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) or local_world_size < 1:
        raise ValueError(f"local_world_size={local_world_size!r}: must be an int >= 1")
    return current_rss() + node_free_memory() // local_world_size


def resolve_budget(config: ShardingConfig, local_world_size: int = 1) -> int:
    """The budget in bytes for this rank, as :class:`ShardingConfig` describes."""
    b = config.budget
    if isinstance(b, int):
        return b
    fraction = config.auto_fraction if b is None else b
    return int(fraction * fair_share(local_world_size))


#: Prior for glibc malloc with default settings (see ``ShardingConfig.allocator_overhead``).
GLIBC_OVERHEAD = 2.0
GLIBC_HINT = (
    "glibc malloc keeps freed activations resident (RSS ~2x the live tensors), so the first plan assumes"
    f" {GLIBC_OVERHEAD}x and later steps measure it; for RSS that follows the live tensors start the process with"
    " GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1048576:glibc.malloc.hugetlb=1 (transparent huge pages keep"
    " the page faults cheap) or preload jemalloc"
)


def returns_freed_memory() -> bool:
    """True when the allocator returns or reuses freed memory well: jemalloc/tcmalloc, or glibc told to mmap
    large blocks at a fixed threshold (which also stops it from raising the threshold as it goes)."""
    from lightning_horizon import cpu  # the allocator probe lives with the other CPU facts

    if cpu.allocator() is not None:
        return True
    return "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "") or "MALLOC_MMAP_THRESHOLD_" in os.environ


def allocator_overhead(config: ShardingConfig) -> float:
    if config.allocator_overhead is not None:
        return float(config.allocator_overhead)
    return 1.0 if returns_freed_memory() else GLIBC_OVERHEAD


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, three significant figures)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"


__all__ = [
    "ShardingConfig",
    "resolve_sharding",
    "resolve_budget",
    "fair_share",
    "node_free_memory",
    "AVAILABLE_MEMORY_ENV",
    "cgroup_free",
    "current_rss",
    "peak_rss",
    "reset_peak_rss",
    "fmt_bytes",
    "allocator_overhead",
    "returns_freed_memory",
    "GLIBC_OVERHEAD",
]
