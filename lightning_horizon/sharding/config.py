"""Graph sharding's configuration, and how its budget resolves to bytes for this rank.

The budget is a whole-process figure (resident set size): the planner subtracts what is already resident
(weights, gradients, optimizer state, the Python heap) and plans the activations into what is left. Where the
budget comes from, in order of precedence:

1. ``ShardingConfig(budget=<int>)``: that many bytes for this rank (under HorizonStrategy, setup refuses a budget
   above what the rank can have: its resident memory plus its share of the free memory, ``memory/check.py``).
2. ``ShardingConfig(budget=<float in (0, 1]>)``: that fraction of this rank's fair share of the node.
3. ``ShardingConfig(budget=None)`` / ``sharding="auto"``: ``auto_fraction`` of the fair share.

The fair share and the node's free memory are the probes of ``lightning_horizon/memory/probe.py`` (cgroup-aware;
``HORIZON_AVAILABLE_MEMORY`` overrides them). Budgets 2 and 3 follow the free memory during training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional, Union

from lightning_horizon.checks import check_int, check_one_of, is_number, require
from lightning_horizon.memory.probe import GLIBC_OVERHEAD, fair_share, returns_freed_memory


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
        owner, b = "ShardingConfig", self.budget
        if b is not None:
            require(is_number(b, 0), owner, "budget", b,
                    "an int (bytes), a float in (0, 1] (fraction) or None (auto); an int must be > 0")
            require(isinstance(b, int) or b <= 1, owner, "budget", b,
                    f"a float in (0, 1] (a fraction of this rank's memory); for bytes pass an int,"
                    f" e.g. budget={int(b)}")
        for name in ("auto_fraction", "headroom", "relax_below", "profile_batch_fraction"):
            value = getattr(self, name)
            require(is_number(value, 0, 1, include_high=True), owner, name, value, "a number in (0, 1]")
        require(self.relax_below < self.headroom, owner, "relax_below", self.relax_below,
                f"a number below headroom={self.headroom!r}, or the plan would tighten and relax on the same"
                " measurement")
        check_int(owner, "relax_after", self.relax_after, 1, " (steps)")
        require(isinstance(self.adaptive, bool), owner, "adaptive", self.adaptive, "True or False")
        overhead = self.allocator_overhead
        require(overhead is None or is_number(overhead, 1, 10, include_low=True, include_high=True), owner,
                "allocator_overhead", overhead, "None (auto) or in [1, 10]")
        check_one_of(owner, "profile", self.profile, ("auto", "fake", "real"))

    @property
    def budget_bytes(self) -> Optional[int]:
        """The budget when given in bytes (an ``int``: fixed for the run); ``None`` for a fraction or auto, which
        are resolved from the node's free memory."""
        return self.budget if isinstance(self.budget, int) else None

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def resolve_sharding(sharding: object) -> Optional[ShardingConfig]:
    """Validate the strategy's ``sharding=`` argument: ``None`` (off), ``"auto"`` or a ``ShardingConfig``."""
    if sharding is None or isinstance(sharding, ShardingConfig):
        return sharding
    hint = ""
    if is_number(sharding, -math.inf, math.inf, include_low=True, include_high=True):
        hint = f"; for a memory budget write sharding=ShardingConfig(budget={sharding!r})"
    require(isinstance(sharding, str) and sharding == "auto", "HorizonStrategy", "sharding", sharding,
            f"None, 'auto' or a ShardingConfig(...){hint}")
    return ShardingConfig()


def resolve_budget(config: ShardingConfig, local_world_size: int = 1) -> int:
    """The budget in bytes for this rank, as :class:`ShardingConfig` describes."""
    if config.budget_bytes is not None:
        return config.budget_bytes
    fraction = config.auto_fraction if config.budget is None else config.budget
    return int(fraction * fair_share(local_world_size))


def allocator_overhead(config: ShardingConfig) -> float:
    """Resident bytes per activation byte that the first plan assumes (see ``ShardingConfig.allocator_overhead``)."""
    if config.allocator_overhead is not None:
        return float(config.allocator_overhead)
    return 1.0 if returns_freed_memory() else GLIBC_OVERHEAD


__all__ = ["ShardingConfig", "allocator_overhead", "resolve_budget", "resolve_sharding"]
