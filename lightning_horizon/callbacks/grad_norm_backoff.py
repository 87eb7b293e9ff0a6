"""GradNormBackoff: clip by the global gradient norm, back the learning rate off on spikes, skip non-finite steps.

Where it acts. Lightning calls ``on_before_optimizer_step`` inside ``optimizer.step(closure)``: after the closure
(forward + backward, so DDP has already averaged the gradients), before Lightning's own clipping and before the
optimizer touches a weight. That single point is used for everything:

1. the fp32 norm of the gradients the step will use (the optimizer's own params: fp32 masters under
   HorizonPrecision), made identical on every rank by a tiny MAX all-reduce of ``[norm, is_nan, is_inf]``
   (one row per node under HorizonStrategy's local SGD, where nodes hold different gradients between averages:
   each node clips by its own norm, the decision below uses the world's);
2. the decision: non-finite -> skip (every grad set to None, so torch optimizers leave weights, moments and step
   counts untouched) and back off; spike -> back off; otherwise count a healthy step and maybe recover;
3. clipping to ``max_norm`` with :func:`lightning_horizon.gradnorm.clip_grads_` (by the node's norm, its coefficient
   in the norm's dtype: float64 for float64 gradients, as ``torch.nn.utils.clip_grad_norm_``);
4. the LR scale: every ``param_group["lr"]`` is multiplied by the scale here, just before the update, and put back
   to the exact value it had by a torch step post-hook, right after the update. Schedulers therefore only ever
   see their own lr -- LambdaLR/OneCycleLR (recompute from ``base_lrs``) and CosineAnnealingLR/LinearLR (build on
   the current lr) alike -- so the effective lr is ``scheduler lr x scale`` at every step, without drift.

Gradient accumulation needs nothing: Lightning only calls the hook on the micro-batch that steps. Manual
optimization goes through the same path (``LightningOptimizer.step`` -> precision -> ``optimizer.step(closure)``).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.optim import Optimizer

from lightning_horizon.callbacks.backoff_world import agree_across_ranks, node_of, rank_zero, scale_error_feedback
from lightning_horizon.checks import check_int, is_number, require
from lightning_horizon.gradnorm import clip_grads_, total_norm_fp32
from lightning_horizon.precision import HorizonPrecision

log = logging.getLogger(__name__)

_STATE_VERSION = 1


@dataclass
class _Stash:
    lrs: list  # the scheduler's lrs, one per param group, as they were before any scale was applied
    applied_by: set = field(default_factory=set)  # ids of the GradNormBackoff instances that scaled this step


# optimizer -> its scheduler lrs while a step runs scaled; shared so that several instances compose and restore once
_LR_STASH: "weakref.WeakKeyDictionary[Optimizer, _Stash]" = weakref.WeakKeyDictionary()


@dataclass
class BackoffState:
    """What GradNormBackoff tracks for one optimizer (all of it goes into the checkpoint)."""

    scale: float = 1.0
    """The current LR multiplier, in ``[min_scale, 1]``."""
    healthy_streak: int = 0
    """Finite, non-spike steps in a row since the last spike, skip or recovery."""
    spikes: int = 0
    """Finite steps whose norm was judged a spike (cumulative)."""
    skipped_steps: int = 0
    """Steps skipped for a non-finite norm (cumulative)."""
    steps: int = 0
    """Optimizer steps seen (cumulative, skipped ones included)."""
    last_grad_norm: float = float("nan")
    """The pre-clip norm of the latest step (not checkpointed)."""
    window: deque = field(default_factory=deque)
    """Recent norms for the z-score test (only filled when ``spike_zscore`` is set)."""


class GradNormBackoff(Callback):
    """Gradient-norm clipping with learning-rate backoff, non-finite step skipping and recovery.

    Args:
        max_norm: clip the global gradient norm to this value (``None``: measure and decide, but do not clip).
        norm_type: the p of the p-norm (``float("inf")`` for the max norm).
        spike_threshold: a finite norm above this is a spike (``None``: no fixed threshold).
        spike_zscore: when set, a norm above ``mean + spike_zscore * std`` of the last ``zscore_window`` norms is
            also a spike (adaptive, ZClip-style). The test starts once the window is full; a spike enters the
            window as ``mean + z * std``, so a lasting shift of the norm is absorbed instead of firing forever.
        zscore_window: how many recent norms the z-score test looks at.
        factor: on a spike or a non-finite step the LR scale is multiplied by this, in (0, 1).
        min_scale: the LR scale never goes below this, in (0, 1].
        recover_after: after this many healthy steps in a row the scale grows by ``recover_factor`` (capped at 1).
        recover_factor: growth per recovery, > 1 (``None``: ``1 / factor``, so one healthy window undoes one backoff).
        skip_nonfinite: skip steps whose norm is NaN/Inf (no weight, moment or step-count change), count them and
            back off. ``False`` leaves such steps alone entirely (no clip, no skip, no backoff), e.g. for an fp16
            GradScaler that skips them itself.
        log_prefix: prepended to the logged names (``grad_norm``, ``lr_scale``, ``spikes``, ``skipped_steps``);
            with several optimizers the names get a ``_opt{i}`` suffix.
    """

    def __init__(
        self,
        max_norm: Optional[float] = 1.0,
        norm_type: float = 2.0,
        spike_threshold: Optional[float] = 1e4,
        spike_zscore: Optional[float] = None,
        zscore_window: int = 100,
        factor: float = 0.8,
        min_scale: float = 0.01,
        recover_after: int = 100,
        recover_factor: Optional[float] = None,
        skip_nonfinite: bool = True,
        log_prefix: str = "",
    ) -> None:
        super().__init__()
        owner = "GradNormBackoff"
        require(max_norm is None or is_number(max_norm, 0), owner, "max_norm", max_norm,
                "a finite number > 0, or None to not clip")
        require(is_number(norm_type, 0, math.inf, include_high=True), owner, "norm_type", norm_type,
                "a number > 0 (float('inf') allowed)")
        require(spike_threshold is None or is_number(spike_threshold, 0, math.inf, include_high=True), owner,
                "spike_threshold", spike_threshold, "a number > 0, or None for no fixed threshold")
        require(spike_zscore is None or is_number(spike_zscore, 0), owner, "spike_zscore", spike_zscore,
                "a finite number > 0, or None for no adaptive threshold")
        check_int(owner, "zscore_window", zscore_window, 2)
        require(is_number(factor, 0, 1), owner, "factor", factor, "a number in (0, 1)")
        require(is_number(min_scale, 0, 1, include_high=True), owner, "min_scale", min_scale, "a number in (0, 1]")
        check_int(owner, "recover_after", recover_after, 1)
        require(recover_factor is None or is_number(recover_factor, 1), owner, "recover_factor", recover_factor,
                "a finite number > 1, or None for 1 / factor")
        require(isinstance(skip_nonfinite, bool), owner, "skip_nonfinite", skip_nonfinite, "True or False")
        require(isinstance(log_prefix, str), owner, "log_prefix", log_prefix, "a string")
        self.max_norm = None if max_norm is None else float(max_norm)
        self.norm_type = float(norm_type)
        self.spike_threshold = None if spike_threshold is None else float(spike_threshold)
        self.spike_zscore = None if spike_zscore is None else float(spike_zscore)
        self.zscore_window = int(zscore_window)
        self.factor = float(factor)
        self.min_scale = float(min_scale)
        self.recover_after = int(recover_after)
        self.recover_factor = 1.0 / self.factor if recover_factor is None else float(recover_factor)
        self.skip_nonfinite = skip_nonfinite
        self.log_prefix = log_prefix
        self._init_args = dict(
            max_norm=max_norm, norm_type=norm_type, spike_threshold=spike_threshold, spike_zscore=spike_zscore,
            zscore_window=zscore_window, factor=factor, min_scale=min_scale, recover_after=recover_after,
            recover_factor=recover_factor, skip_nonfinite=skip_nonfinite, log_prefix=log_prefix,
        )
        self._states: list[BackoffState] = []
        self._optimizers: list[Optimizer] = []  # same order as _states (trainer.optimizers order when known)
        self._hooks: dict[int, Any] = {}  # id(optimizer) -> post-hook handle

    # ------------------------------------------------------------------ public read-outs (optimizer 0)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(**self._init_args)

    @property
    def states(self) -> tuple[BackoffState, ...]:
        """One :class:`BackoffState` per optimizer, in ``trainer.optimizers`` order."""
        return tuple(self._states)

    @property
    def lr_scale(self) -> float:
        return self._states[0].scale if self._states else 1.0

    @property
    def spikes(self) -> int:
        return self._states[0].spikes if self._states else 0

    @property
    def skipped_steps(self) -> int:
        return self._states[0].skipped_steps if self._states else 0

    @property
    def last_grad_norm(self) -> float:
        return self._states[0].last_grad_norm if self._states else float("nan")

    # ------------------------------------------------------------------ Lightning hooks

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        clip_val = getattr(trainer, "gradient_clip_val", None)
        if stage == "fit" and clip_val and self.max_norm is not None:
            log.info("GradNormBackoff clips to max_norm=%g; Lightning's gradient_clip_val=%g clips again after it "
                     "(on already clipped gradients).", self.max_norm, clip_val)

    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Optimizer
    ) -> None:
        idx = self._index_of(trainer, optimizer)
        st = self._states[idx]
        # my scale still applied means the step never ran or the closure was called twice: start from clean lrs
        self._restore_lr(optimizer, only_if_mine=True)

        params = [p for group in optimizer.param_groups for p in group["params"]]
        measured = self._step_norm(trainer, params)
        norm, clip_norm = agree_across_ranks(measured, *node_of(trainer))
        st.steps += 1
        st.last_grad_norm = norm
        if not math.isfinite(norm):
            if self.skip_nonfinite:
                self._skip(trainer, params, st)
            self._log(trainer, pl_module, idx, st)
            return
        self._judge(trainer, st, norm)
        if self.max_norm is not None:
            self._clip(trainer, params, torch.tensor(clip_norm, dtype=measured.dtype))
        self._apply_lr_scale(optimizer, st.scale)
        self._log(trainer, pl_module, idx, st)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        for opt in self._optimizers:
            self._restore_lr(opt)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        for opt in self._optimizers:
            self._restore_lr(opt)
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._optimizers.clear()  # the states stay: they are the callback's memory across fits

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "optimizers": [
                {"scale": s.scale, "healthy_streak": s.healthy_streak, "spikes": s.spikes,
                 "skipped_steps": s.skipped_steps, "steps": s.steps, "window": list(s.window)}
                for s in self._states
            ],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._states = [
            BackoffState(scale=float(d["scale"]), healthy_streak=int(d["healthy_streak"]), spikes=int(d["spikes"]),
                         skipped_steps=int(d["skipped_steps"]), steps=int(d["steps"]), window=deque(d["window"]))
            for d in state_dict["optimizers"]
        ]

    # ------------------------------------------------------------------ internals

    def _index_of(self, trainer: "pl.Trainer", optimizer: Optimizer) -> int:
        """The optimizer's position (trainer.optimizers order), registering the lr post-hook the first time."""
        known = [i for i, o in enumerate(self._optimizers) if o is optimizer]
        if not known:
            order = [i for i, o in enumerate(getattr(trainer, "optimizers", [])) if o is optimizer]
            idx = order[0] if order else len(self._optimizers)
            while len(self._optimizers) <= idx:
                self._optimizers.append(None)  # type: ignore[arg-type]  # filled when that optimizer first steps
            self._optimizers[idx] = optimizer
            self._hooks[id(optimizer)] = optimizer.register_step_post_hook(self._after_step)
            known = [idx]
        while len(self._states) <= known[0]:
            self._states.append(BackoffState())
        return known[0]

    def _step_norm(self, trainer: "pl.Trainer", params: list[Tensor]) -> Tensor:
        """The step's pre-clip fp32 norm. HorizonPrecision owns it: it measured it over these very gradients right
        before this hook, once per step. With another precision plugin, or another ``norm_type``, it is measured
        here, by the same function."""
        plugin = trainer.precision_plugin
        if isinstance(plugin, HorizonPrecision) and plugin.last_grad_norm is not None and self.norm_type == 2.0:
            return plugin.last_grad_norm
        state = getattr(trainer.strategy, "training_state", None)  # HorizonStrategy: summed over node-sharded state
        if state is not None:
            return state.grad_norm(params, self.norm_type)
        return total_norm_fp32(params, self.norm_type)

    def _skip(self, trainer: "pl.Trainer", params: list[Tensor], st: BackoffState) -> None:
        """A non-finite norm: no step, and a backoff."""
        state = getattr(trainer.strategy, "training_state", None)  # HorizonStrategy: the tables' sparse ones too
        if state is not None:
            state.skip(params)
        else:
            for p in params:
                p.grad = None  # torch optimizers skip params without a grad: weights and state stay as they are
        st.skipped_steps += 1
        old = self._back_off(st)
        rank_zero(trainer, log.warning, "GradNormBackoff: non-finite gradient norm (%s) at step %d: step skipped (%d so"
                   " far); lr scale %.4g -> %.4g.", st.last_grad_norm, trainer.global_step, st.skipped_steps, old,
                   st.scale)

    def _judge(self, trainer: "pl.Trainer", st: BackoffState, norm: float) -> None:
        """A finite norm: a spike backs the scale off; a healthy step counts towards a recovery."""
        limit = self._spike_limit(st, norm)
        if limit is not None:
            st.spikes += 1
            old = self._back_off(st)
            rank_zero(trainer, log.warning, "GradNormBackoff: gradient norm spike %.4g > %.4g at step %d (%d so far): "
                       "lr scale %.4g -> %.4g.", norm, limit, trainer.global_step, st.spikes, old, st.scale)
            return
        st.healthy_streak += 1
        if st.healthy_streak >= self.recover_after and st.scale < 1.0:
            old = st.scale
            st.scale = min(1.0, st.scale * self.recover_factor)
            st.healthy_streak = 0
            rank_zero(trainer, log.info, "GradNormBackoff: %d healthy steps at step %d: lr scale %.4g -> %.4g.",
                       self.recover_after, trainer.global_step, old, st.scale)

    def _back_off(self, st: BackoffState) -> float:
        """Multiply the scale by ``factor`` (down to ``min_scale``) and restart the healthy streak; the old scale."""
        old = st.scale
        st.scale = max(self.min_scale, st.scale * self.factor)
        st.healthy_streak = 0
        return old

    def _spike_limit(self, st: BackoffState, norm: float) -> Optional[float]:
        """The lowest limit ``norm`` exceeds (the fixed threshold, the z-score one), ``None`` when it is no spike;
        ``norm`` enters the z-score window (a spike capped at the limit, once the window is full)."""
        zlimit = self._zscore_limit(st)
        is_spike = (self.spike_threshold is not None and norm > self.spike_threshold) or (
            zlimit is not None and norm > zlimit
        )
        if self.spike_zscore is not None and (zlimit is not None or not is_spike):
            st.window.append(norm if zlimit is None else min(norm, zlimit))
            while len(st.window) > self.zscore_window:
                st.window.popleft()
        if not is_spike:
            return None
        return min(x for x in (self.spike_threshold, zlimit) if x is not None and norm > x)

    def _clip(self, trainer: "pl.Trainer", params: list[Tensor], clip_norm: Tensor) -> None:
        """Clip to ``max_norm`` by ``clip_norm`` (the node's norm under local SGD, in the measured norm's dtype:
        float64 for float64 gradients, as ``clip_grad_norm_`` computes its coefficient)."""
        # as clip_grad_norm_: scaled by max_norm / (norm + 1e-6) whenever that is below 1, so also a norm a hair
        # under max_norm (a user's own clip to the same value first); clip_grads_ writes nothing otherwise
        state = getattr(trainer.strategy, "training_state", None)  # HorizonStrategy: out-of-core streams
        clip = state.clip if state is not None else clip_grads_
        factor = clip(params, self.max_norm, clip_norm)
        scale_error_feedback(trainer, params, factor)

    def _zscore_limit(self, st: BackoffState) -> Optional[float]:
        if self.spike_zscore is None or len(st.window) < self.zscore_window:
            return None
        n = len(st.window)
        mean = sum(st.window) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in st.window) / n)
        return mean + self.spike_zscore * std

    def _apply_lr_scale(self, optimizer: Optimizer, scale: float) -> None:
        if scale == 1.0:
            return  # nothing to do and nothing to put back
        stash = _LR_STASH.get(optimizer)
        if stash is None:  # the first scaler of this step keeps the scheduler's lrs; later ones multiply on top
            stash = _LR_STASH[optimizer] = _Stash(
                lrs=[g["lr"].clone() if isinstance(g["lr"], Tensor) else g["lr"] for g in optimizer.param_groups]
            )
        stash.applied_by.add(id(self))
        for group in optimizer.param_groups:
            if isinstance(group["lr"], Tensor):  # tensor lr (capturable/fused optimizers): schedulers fill_ it
                group["lr"].mul_(scale)
            else:
                group["lr"] = group["lr"] * scale

    def _restore_lr(self, optimizer: Optional[Optimizer], only_if_mine: bool = False) -> None:
        """Put the scheduler's lrs back (the stash is shared, so every instance's scale goes at once)."""
        stash = _LR_STASH.get(optimizer) if optimizer is not None else None
        if stash is None or (only_if_mine and id(self) not in stash.applied_by):
            return
        del _LR_STASH[optimizer]
        for group, lr in zip(optimizer.param_groups, stash.lrs):
            if isinstance(lr, Tensor):
                group["lr"].copy_(lr)
            else:
                group["lr"] = lr

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._restore_lr(optimizer)

    def _log(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", idx: int, st: BackoffState) -> None:
        if getattr(trainer, "logger", None) is None and not getattr(trainer, "loggers", None):
            return
        suffix = f"_opt{idx}" if len(getattr(trainer, "optimizers", [])) > 1 else ""
        values = {"grad_norm": st.last_grad_norm, "lr_scale": st.scale,
                  "spikes": float(st.spikes), "skipped_steps": float(st.skipped_steps)}
        for name, value in values.items():
            # values are identical on every rank already: no sync_dist
            pl_module.log(f"{self.log_prefix}{name}{suffix}", value, on_step=True, on_epoch=False, logger=True)
