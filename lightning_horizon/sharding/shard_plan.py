"""What a sharding plan is: the calls it recomputes, its shards (a row each in the table printed at fit start), its
estimates, and the form it takes in a checkpoint; plan.py is the planner that makes one."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from lightning_horizon.memory.probe import fmt_bytes


class InfeasibleBudgetError(ValueError):
    """No plan fits; ``smallest_feasible`` is the least budget (bytes) for which one does."""

    def __init__(self, message: str, smallest_feasible: int) -> None:
        super().__init__(message)
        self.smallest_feasible = smallest_feasible


@dataclass
class Shard:
    modules: list[str]
    mode: str  #: "store" or "recompute"
    params: int
    peak: int  #: estimated peak RSS while this shard runs backward


@dataclass
class ShardPlan:
    recompute: list[tuple[str, int]]  #: (module path, occurrence) of every call to checkpoint
    shards: list[Shard]
    budget: int
    target: int  #: what the plan aims at: headroom * budget, or the budget itself when nothing is recomputed
    fixed: int  #: resident before the step (weights, optimizer state, runtime)
    estimated_peak: int
    recompute_flops: int
    forward_flops: int
    scale: float  #: calibration applied to the profiled activation bytes (1 until a re-plan measures)
    profile_mode: str
    floor: int = 0  #: smallest estimated peak any plan on this profile reaches
    counted: list[str] = field(default_factory=list)  #: modules called more than once per step

    def table(self) -> str:
        """The plan as printed at fit start: one row per shard."""
        overhead = self.recompute_flops / (3 * self.forward_flops) if self.forward_flops else 0.0
        lines = [
            f"ShardPlan: budget {fmt_bytes(self.budget)} (aim {fmt_bytes(self.target)}) | resident"
            f" {fmt_bytes(self.fixed)} | estimated peak {fmt_bytes(self.estimated_peak)} | recompute"
            f" {len(self.recompute)} call(s), +{overhead:.1%} step FLOPs | profile {self.profile_mode}"
            + (f" | activation scale x{self.scale:.2f}" if self.scale != 1.0 else ""),
            f"{'shard':>5}  {'modules':<48} {'params':>10} {'est. peak':>10}  mode",
        ]
        for i, s in enumerate(self.shards):
            lines.append(
                f"{i:>5}  {_compress(s.modules):<48} {fmt_bytes(s.params):>10} {fmt_bytes(s.peak):>10}  {s.mode}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["recompute"] = [list(k) for k in self.recompute]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ShardPlan":
        d = dict(d)
        d["recompute"] = [(str(n), int(o)) for n, o in d["recompute"]]
        d["shards"] = [Shard(**s) for s in d["shards"]]
        return cls(**d)


def _compress(names: list[str], width: int = 48) -> str:
    """['h.0', 'h.1', 'h.2.attn', 'h.3.attn'] -> 'h.0-1, h.2-3.attn' (runs of consecutive indices merged)."""
    runs: list[list] = []  # [prefix, first, last, rest]
    for n in names:
        m = re.match(r"^(.*?\.)(\d+)((?:\..*)?)$", n)
        if m and runs and runs[-1][0] == m[1] and runs[-1][3] == m[3] and runs[-1][2] == int(m[2]) - 1:
            runs[-1][2] = int(m[2])
        elif m:
            runs.append([m[1], int(m[2]), int(m[2]), m[3]])
        else:
            runs.append([n, None, None, ""])
    parts = [r[0] if r[1] is None else f"{r[0]}{r[1]}{'-' + str(r[2]) if r[2] != r[1] else ''}{r[3]}" for r in runs]
    text = ", ".join(parts) or "(step code)"
    return text if len(text) <= width else text[: width - 1] + "…"


__all__ = ["InfeasibleBudgetError", "Shard", "ShardPlan"]
