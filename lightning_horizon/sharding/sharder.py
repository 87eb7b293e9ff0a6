"""GraphSharder: profile, plan, install, measure, re-plan; the one object the strategy talks to.

Lifecycle (the strategy calls these; a plain training loop can too):

- ``maybe_plan(module, batch, batch_idx)`` right before every ``training_step``. The first call resolves the
  budget, profiles the step on this batch (there is no batch earlier), plans and installs. Later calls apply a
  pending re-plan, at the step boundary, where no activation is alive.
- ``after_step()`` after every optimizer step: reads the RSS high-water mark of the step, resets it, and
  decides whether the next step needs a re-plan (tighter above ``headroom`` x budget, or, for a plan that
  recomputes nothing, above the budget plus the same margin; looser after ``relax_after``
  steps below ``relax_below``). An ``auto`` or fractional budget is resolved again from the node's free memory,
  and a budget that fell below the plan re-plans too (``set_budget`` does the same for a budget in bytes).
  Every decision that changes something is logged with its reason.
- ``uninstall()`` at teardown: every patched ``forward`` is restored; the model is as it was.
- ``state_dict()`` / ``load_state_dict()``: plan, calibration and history, so a resumed run recomputes the
  same calls (same memory, same speed) without having to re-learn them.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_horizon.checks import check_int, is_int, require
from lightning_horizon.console import info_once
from lightning_horizon.memory.estimate import optimizer_state_pending
from lightning_horizon.memory.probe import GLIBC_HINT, current_rss, fmt_bytes, peak_rss, reset_peak_rss
from lightning_horizon.parts import Part
from lightning_horizon.sharding.config import ShardingConfig, allocator_overhead, resolve_budget, resolve_sharding
from lightning_horizon.sharding.executor import Installed, RecomputeContext, install
from lightning_horizon.sharding.plan import InfeasibleBudgetError, ShardPlan, evaluate, make_plan
from lightning_horizon.sharding.isolation import ensure_real
from lightning_horizon.sharding.profile import Profile, profile_step

log = logging.getLogger(__name__)
_STATE_VERSION = 1


class Reading(enum.Enum):
    """Where a step's measured peak lies, which decides what :meth:`GraphSharder.after_step` does."""

    #: above the re-plan line (:meth:`GraphSharder._line`): more recompute, or a warning where none is left to add
    ABOVE = "above"
    #: below ``relax_below`` x budget, with calls recomputed and a resettable high-water mark: counts towards less
    LOW = "low"
    #: in between: the count of low steps starts over
    STEADY = "steady"


class GraphSharder(Part):
    """Memory-budgeted activation recompute for one module, planned from its profiled step.

    Args:
        config: ``None`` or ``"auto"`` (defaults) or a :class:`ShardingConfig`.
        local_world_size: ranks on this node, which share its memory fairly.
        optimizers: the optimizers, to foresee their lazily allocated state; ``None`` takes
            ``module.trainer.optimizers`` when the module is attached to a Trainer.
        rank: this process's global rank; plan tables are logged on rank 0 only.
        recompute_context: ``module -> context manager`` entered around each recompute of ``module``'s call (in
            backward, outside training_step): the precision plugin's ``recompute_context``, which re-establishes
            what its forward context did (fp32 copies of bf16 weights, the default dtype). ``None``: none needed.
        state_in_memory: whether the optimizer state still to come and the gradients backward makes will be resident
            (``False`` under the out-of-core store, which keeps them on disk: only the layer in use is in memory).
    """

    label = "HorizonStrategy(sharding=...)"

    def __init__(
        self,
        config: Union[None, str, ShardingConfig] = None,
        local_world_size: int = 1,
        optimizers: Optional[list[torch.optim.Optimizer]] = None,
        rank: int = 0,
        recompute_context: Optional[RecomputeContext] = None,
        state_in_memory: bool = True,
    ) -> None:
        if recompute_context is not None and not callable(recompute_context):
            raise ValueError(
                f"recompute_context={recompute_context!r}: must be None or a callable taking a module and returning"
                " a context manager"
            )
        self.recompute_context = recompute_context
        self.state_in_memory = state_in_memory
        self.config = resolve_sharding("auto" if config is None else config)
        check_int("GraphSharder", "local_world_size", local_world_size, 1, " (ranks on this node)")
        self.local_world_size = local_world_size
        self.rank = rank
        self._optimizers = optimizers
        self.module: Optional[nn.Module] = None
        self.profile: Optional[Profile] = None
        self.plan: Optional[ShardPlan] = None
        self.budget: Optional[int] = None
        self.fixed: Optional[int] = None  # resident before the first step, plus optimizer state still to come
        # Resident bytes per profiled activation byte: the allocator's prior until a step is measured.
        self.scale = allocator_overhead(self.config)
        self.steps = 0
        self.history: list[dict[str, Any]] = []  # every plan installed: step, reason, recompute count, estimate
        self.last_peak: Optional[int] = None
        self._installed: Optional[Installed] = None
        self._pending: Optional[tuple[str, float]] = None  # (reason, new scale) applied at the next boundary
        self._low_steps = 0
        self._low_ratio = 0.0
        self._resettable = True
        self._at_floor_warned = False
        self._grads_in_forward = False
        self._stepped = False  # a training_step ran since the last after_step
        self._loaded: Optional[dict[str, Any]] = None
        self._early_budget: Optional[int] = None

    # ------------------------------------------------------------------ the strategy's calls

    def maybe_plan(self, module: nn.Module, batch: Any, batch_idx: int = 0) -> None:
        """Plan and install on the first call; apply a pending re-plan on later ones (a step boundary)."""
        if self._installed is None or module is not self.module:
            self._first_plan(module, batch, batch_idx)
        elif self._pending is not None:
            reason, scale = self._pending
            self._pending = None
            self._replan(scale, reason)
        assert self._installed is not None
        self._installed.reset()
        self._stepped = True

    def before_training_step(self, module: nn.Module, batch: Any, batch_idx: int, step_context: Any) -> None:
        # At the step boundary: the first call profiles this batch and installs the plan, later ones apply a pending
        # re-plan. Under the precision's context, so that the profile sees the step's dtypes.
        with step_context():
            self.maybe_plan(module, batch, batch_idx)

    def after_training_step(self, output: Any) -> None:
        self.check_output(output)

    def after_step(self, peak: Optional[int] = None) -> None:
        """Measure the step's peak RSS (or take ``peak``) and decide whether the next step re-plans: what it does
        depends on where the peak is (:class:`Reading`)."""
        peak = self._measure(peak)
        if peak is None or not self.config.adaptive:
            return
        if not isinstance(self.config.budget, int) and self._follow_free_memory():
            return  # re-plans at the next boundary for the new budget
        plan, budget = self.plan, self.budget
        assert plan is not None and budget is not None and self.fixed is not None
        estimated = max(1, plan.estimated_peak - self.fixed)
        ratio = max(0.0, (peak - self.fixed) / estimated)  # measured / estimated activation memory
        line = self._line(plan, budget)
        reading = self._read(peak, line, plan, budget)
        if reading is Reading.ABOVE:
            self._tighten(peak, ratio, line)
        elif reading is Reading.LOW:
            self._count_low(ratio)
        else:
            self._low_steps, self._low_ratio = 0, 0.0

    def _measure(self, peak: Optional[int]) -> Optional[int]:
        """The step's peak RSS (``peak`` if given), the step counted; ``None`` where there is nothing to read: no
        plan yet, a second optimizer of the same step, or a high-water mark that cannot be reset and says nothing
        new."""
        if self.plan is None or not self._stepped:
            return None  # a second optimizer of the same step: its peak is the step's, measured already
        self._stepped = False
        self.steps += 1
        if peak is None:
            peak = peak_rss()
            if not self._resettable and self.last_peak is not None and peak <= self.last_peak:
                return None  # a high-water mark that cannot be reset says nothing new about this step
            self._resettable = reset_peak_rss()
        self.last_peak = peak
        return peak

    def _read(self, peak: int, line: float, plan: ShardPlan, budget: int) -> Reading:
        if peak > line:
            return Reading.ABOVE
        if peak < self.config.relax_below * budget and plan.recompute and self._resettable:
            return Reading.LOW
        return Reading.STEADY

    def _tighten(self, peak: int, ratio: float, line: float) -> None:
        """Above the line: more recompute at the next boundary, or, with none left to add, a warning (once)."""
        cfg, plan, budget = self.config, self.plan, self.budget
        assert plan is not None and budget is not None
        self._low_steps, self._low_ratio = 0, 0.0
        if plan.estimated_peak <= plan.floor:
            if not self._at_floor_warned:
                log.warning(
                    f"sharding[rank {self.rank}] step {self.steps}: measured peak {fmt_bytes(peak)} ="
                    f" {peak / budget:.0%} of the budget {fmt_bytes(budget)}, but the plan already recomputes"
                    " all it can: raise the budget, or shrink the batch or sequence"
                )
                self._at_floor_warned = True
            return
        scale = self.scale * max(ratio, 1.0) * 1.05  # at least 5% tighter, so that it converges
        above = (f"headroom {cfg.headroom:.0%}" if plan.recompute
                 else f"{line / budget:.0%} of it (nothing recomputed)")
        self._pending = (
            f"measured peak {fmt_bytes(peak)} = {peak / budget:.0%} of the budget {fmt_bytes(budget)}, above"
            f" {above} (estimate was {fmt_bytes(plan.estimated_peak)}): more recompute",
            scale,
        )

    def _count_low(self, ratio: float) -> None:
        """Below ``relax_below``: one more low step; after ``relax_after`` of them, less recompute at the next
        boundary where the steps' largest ratio makes it worth it, and the count starts over."""
        cfg = self.config
        self._low_steps += 1
        self._low_ratio = max(self._low_ratio, ratio)
        if self._low_steps < cfg.relax_after:
            return
        # 10% above the largest ratio seen, and at most halved at once: a run of short batches must not
        # make the plan believe that activations are free
        scale = self.scale * max(0.5, min(1.0, self._low_ratio * 1.1))
        if scale < 0.95 * self.scale:
            self._pending = (
                f"{self._low_steps} steps below {cfg.relax_below:.0%} of the budget (highest peak"
                f" {self._low_ratio:.0%} of the estimated activations): less recompute",
                scale,
            )
        self._low_steps, self._low_ratio = 0, 0.0

    def set_budget(self, budget: int, reason: str = "budget set") -> bool:
        """Change the budget (bytes) during training. When the current plan no longer fits under ``headroom`` of
        it, the next step boundary re-plans with more recompute (True); otherwise the plan stays (False). An
        ``auto`` or fractional budget goes on following the node's free memory from there."""
        require(is_int(budget, 1), "GraphSharder.set_budget", "budget", budget, "an int > 0 (bytes)")
        old, self.budget = self.budget, budget
        self._low_steps, self._low_ratio = 0, 0.0
        if self.plan is None:
            self._early_budget = budget
        # the planner's own rule: a recompute plan's estimate under headroom, a plain step's within the budget
        aim = self.config.headroom * budget if self.plan is not None and self.plan.recompute else budget
        if self.plan is None or self.plan.estimated_peak <= aim:
            log.info(f"sharding[rank {self.rank}] step {self.steps}: {reason}: budget {fmt_bytes(old or 0)} ->"
                     f" {fmt_bytes(budget)}; the plan still fits")
            return False
        self._pending = (f"{reason}: budget {fmt_bytes(old or 0)} -> {fmt_bytes(budget)}, below the plan's"
                         f" estimated peak {fmt_bytes(self.plan.estimated_peak)}: more recompute", self.scale)
        return True

    def _line(self, plan: ShardPlan, budget: int) -> float:
        """Above this RSS the plan is re-planned with more recompute. A plan that recomputes aims at ``headroom``
        x budget, a margin for the error of its estimate, and is re-planned above that line. A plan that
        recomputes nothing is the plain step, planned because its estimate fits the budget; its measured peak
        varies by 1-2% from run to run (allocator, the profile's own few MB), and recomputing for that would
        cost several % of speed for memory within the noise: it is re-planned when it exceeds the budget by
        more than the same margin, ``(1 - headroom)`` x budget."""
        return self.config.headroom * budget if plan.recompute else (2.0 - self.config.headroom) * budget

    def _follow_free_memory(self) -> bool:
        """An ``auto`` or fractional budget follows the node's free memory (another job starting, a cgroup limit
        lowered): re-resolved after every step, changed when it moved by more than 5%."""
        assert self.budget is not None
        fresh = resolve_budget(self.config, self.local_world_size)
        if abs(fresh - self.budget) <= 0.05 * self.budget:
            return False
        return self.set_budget(fresh, f"the node's free memory {'fell' if fresh < self.budget else 'rose'}")

    def after_optimizer_step(self) -> None:
        """HorizonStrategy's part hook, called after every optimizer step."""
        self.after_step()

    def teardown(self) -> None:
        """A part hook, at the end of a fit: :meth:`uninstall`."""
        self.uninstall()

    def uninstall(self) -> None:
        """Restore every patched ``forward``: the module is exactly as before the first plan."""
        if self._installed is not None:
            self._installed.remove()
            self._installed = None

    def check_output(self, output: Any) -> Any:
        """Return training_step's ``output``, or raise when it holds a fake or meta tensor (the strategy calls this
        before Lightning or a callback sees it): a fake pass must never leak into training."""
        ensure_real(output, "training_step")
        return output

    def plan_table(self) -> str:
        if self.plan is None:
            return "ShardPlan: none yet (planned at the first training step, from its batch)"
        return self.plan.table()

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "budget": self.budget,
            "scale": self.scale,
            "steps": self.steps,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "history": self.history[-100:],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"sharding state version={state.get('version')!r}: this build reads {_STATE_VERSION}")
        self.scale = float(state["scale"])
        self.steps = int(state["steps"])
        self.history = list(state["history"])
        self._loaded = state
        if self._installed is not None:  # loaded mid-run: re-plan with the restored calibration at the boundary
            self._pending = ("state loaded from a checkpoint", self.scale)

    # ------------------------------------------------------------------ planning

    def _first_plan(self, module: nn.Module, batch: Any, batch_idx: int) -> None:
        self.uninstall()
        self.module = module
        resident = current_rss()  # before profiling: a real profiling pass leaves freed heap behind
        early, self._early_budget = self._early_budget, None  # set_budget before the first step
        self.budget = early or resolve_budget(self.config, self.local_world_size)
        optimizers = self._optimizers
        if optimizers is None:
            trainer = getattr(module, "_trainer", None)
            optimizers = trainer.optimizers if trainer is not None else []
        # the optimizer state still to come is resident, unless the out-of-core store holds it (state_in_memory)
        self.fixed = resident + (optimizer_state_pending(optimizers) if self.state_in_memory else 0)
        # Under a Trainer the previous step's gradients live until the next backward (zeroed after
        # training_step); a plain loop that zeroes them before the forward does not pay for them there.
        self._grads_in_forward = getattr(module, "_trainer", None) is not None
        self.profile = profile_step(
            module, batch, batch_idx, self.config.profile, self.config.profile_batch_fraction
        )
        if not self.state_in_memory:  # the out-of-core store takes each layer's gradients to disk as backward goes
            self.profile = dataclasses.replace(self.profile, pending_grad_bytes=0)
        plan, reason = None, "first plan"
        loaded, self._loaded = self._loaded, None
        if loaded is not None and loaded.get("plan") is not None:
            saved = ShardPlan.from_dict(loaded["plan"])
            plan = evaluate(self.profile, saved.recompute, self.budget, self.fixed, self.config.headroom, self.scale,
                            self._grads_in_forward)
            # Within the budget is enough: the saved plan was made to aim at the headroom line, and a few MB of
            # RSS that moved since must not change what a resumed run recomputes (the steps will measure it).
            if plan is not None and plan.estimated_peak <= plan.budget:
                reason = "restored from the checkpoint"
            else:
                plan, reason = None, "the checkpoint's plan does not fit this run's budget or model: re-planned"
        if plan is None:
            # Raises InfeasibleBudgetError, stating the smallest feasible budget, before any step runs.
            plan = self._make_plan(self.scale)
        self._install(plan, reason)
        self._resettable = reset_peak_rss()
        if not self._resettable:
            log.warning(
                "sharding: this kernel does not let the RSS high-water mark be reset (/proc/self/clear_refs):"
                " peaks are measured since process start, so the plan can tighten but never relaxes"
            )

    def _replan(self, scale: float, reason: str) -> None:
        assert self.profile is not None and self.budget is not None and self.fixed is not None and self.plan
        try:
            plan = self._make_plan(scale)
        except InfeasibleBudgetError as e:
            plan = self._make_plan(scale, best_effort=True)
            reason += f"; no plan fits, using the one with the smallest peak ({e})"
        self.scale = scale
        if plan.recompute == self.plan.recompute:
            self.plan = plan
            log.info(f"sharding[rank {self.rank}] step {self.steps}: re-plan ({reason}): same calls recomputed")
            self._record(reason, changed=False)
            return
        self._install(plan, reason)

    def _make_plan(self, scale: float, best_effort: bool = False) -> ShardPlan:
        assert self.profile is not None and self.budget is not None and self.fixed is not None
        return make_plan(self.profile, self.budget, self.fixed, self.config.headroom, scale, best_effort,
                         self._grads_in_forward)

    def _install(self, plan: ShardPlan, reason: str) -> None:
        assert self.module is not None
        self.uninstall()
        self._installed = install(self.module, plan.recompute, plan.counted, self.recompute_context)
        old = self.plan
        self.plan = plan
        self._record(reason, changed=True)
        if old is None:
            if self.rank == 0:
                log.info(f"sharding: {reason}\n{plan.table()}")
                if self.config.allocator_overhead is None and self.scale > 1.0:
                    info_once(log, f"sharding: {GLIBC_HINT}")  # a hint, once per process
        else:
            log.info(
                f"sharding[rank {self.rank}] step {self.steps}: re-plan ({reason}): recompute"
                f" {len(old.recompute)} -> {len(plan.recompute)} call(s), estimated peak"
                f" {fmt_bytes(old.estimated_peak)} -> {fmt_bytes(plan.estimated_peak)}"
            )
            if self.rank == 0:
                log.debug(plan.table())

    def _record(self, reason: str, changed: bool) -> None:
        assert self.plan is not None
        self.history.append({
            "step": self.steps, "reason": reason, "changed": changed, "recompute": len(self.plan.recompute),
            "estimated_peak": self.plan.estimated_peak, "measured_peak": self.last_peak, "scale": self.scale,
        })


__all__ = ["GraphSharder"]
