"""The optimizer step, one layer at a time: the out-of-core store's replacement for ``optimizer.step``.

Installed as an instance attribute of the torch optimizer (what Lightning, the precision plugins and a scheduler's
step counter call), it runs the closure once, as torch does, and steps the parameters unit by unit
(:func:`lightning_horizon.optim.step_in_parts`); after each unit its state moves into the store and the unit
is written back and leaves memory. Each unit's state is read and written once per step. Per-parameter optimizers
compute exactly what one whole step computes. Parameters the store does not hold (Kahan's fp32 proxies, which its
own chunked step settles) step together, in one call. When the units step:

- in backward (``StoreConfig(step="in_backward")``): each unit as soon as its gradients are complete (the store's
  post-accumulate-grad hook says so), while its weights and gradients are still in memory: the step reads only the
  unit's optimizer state, read ahead with its weights. Whatever runs between backward and the step would see
  weights already stepped or could not change the step any more (a gradient norm for clipping or a skip,
  ``on_after_backward``, ``on_before_optimizer_step``, several ranks averaging the gradients): such a fit steps
  after backward (:func:`backward_step_conflicts` names what is in the way);
- after backward: once the closure has returned, unit by unit, the next one's files (weights, gradients, masters,
  optimizer state) read in while one steps.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from torch.optim.optimizer import _global_optimizer_pre_hooks

from lightning_horizon.precision import HorizonPrecision
from lightning_horizon.optim import ParamSlice, step_in_parts, torch_optimizer
from lightning_horizon.state import TrainingState
from lightning_horizon.store.store import StateStore
from lightning_horizon.store.units import Unit

_MISSING = object()


class StreamedStep:
    """``optimizer.step`` one unit at a time; :meth:`remove` puts the previous ``step`` back."""

    def __init__(self, optimizer: Optimizer, store: StateStore, training_state: TrainingState,
                 in_backward: bool = False) -> None:
        self.optimizer, self.store, self.training_state = optimizer, store, training_state
        self.in_backward = in_backward
        self._early: set[int] = set()  # ids of the parameters this step stepped in backward
        self._previous = optimizer.__dict__.get("step", _MISSING)  # a scheduler's step counter wraps it so
        self._original = optimizer.step
        if hasattr(self._original, "_wrapped_by_lr_sched"):  # it still counts the steps a scheduler checks for
            self._wrapped_by_lr_sched = True
        optimizer.step = self  # type: ignore[method-assign]

    def parts(self) -> list[ParamSlice]:
        """(group, parameter) pairs with a gradient not stepped yet, by unit in the store's order; unknown ones last,
        together."""
        by_unit: dict[int, list[tuple[int, Tensor]]] = {}
        for i, g in enumerate(self.optimizer.param_groups):
            for x in g["params"]:
                if x.grad is not None and id(x) not in self._early:
                    u = self._unit(x)
                    by_unit.setdefault(u.index if u is not None else len(self.store.units), []).append((i, x))
        return [by_unit[k] for k in sorted(by_unit)]

    def _unit(self, x: Tensor) -> Optional[Unit]:
        """The store's unit of the parameter ``x`` stands for (a master: its parameter's); None: no unit."""
        return self.store.unit_of.get(id(self.training_state.parameter_of(x)))

    def __call__(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        loss = None
        self._early.clear()
        if closure is not None:
            if self.in_backward:
                self.store.unit_ready = lambda u: self._step_unit(u, kwargs)
            try:
                with torch.enable_grad():
                    loss = closure()
            finally:
                self.store.unit_ready = None
        self.store.new_step()
        parts = self.parts()
        if len(parts) <= 1 and not self._early:
            out = self._original(**kwargs)
            self.training_state.settle(self.optimizer, [x for part in parts for _, x in part])
            return loss if closure is not None else out
        units = [self._unit(part[0][1]) for part in parts]

        def step(k: int, part: ParamSlice) -> Any:
            if k + 1 < len(parts) and units[k + 1] is not None:
                self.store.prefetch(units[k + 1])
            return self._step_part(part, kwargs)

        # what backward did not step (all of it after backward; in backward: units with a parameter that got no
        # gradient, parameters of no unit); an empty part still ends the step (its post-hooks)
        numbered = list(enumerate(parts)) or [(0, [])]
        out = step_in_parts(self.optimizer, numbered, lambda kp: step(*kp), first=not self._early)
        return loss if closure is not None else out

    def _step_part(self, part: ParamSlice, kwargs: dict[str, Any]) -> Any:
        groups = self.optimizer.param_groups
        for i, x in part:
            groups[i]["params"].append(x)
        out = self._original(**kwargs)
        self.training_state.settle(self.optimizer, [x for _, x in part])
        return out

    def _step_unit(self, unit: Unit, kwargs: dict[str, Any]) -> None:
        """In backward: ``unit``'s gradients are complete; its parameters step now (the step's first call fires the
        pre-hooks; the post-hooks wait for the end of the step)."""
        part = [(i, x) for i, g in enumerate(self.optimizer.param_groups) for x in g["params"]
                if x.grad is not None and self._unit(x) is unit]
        if part:
            step_in_parts(self.optimizer, [part], lambda p: self._step_part(p, kwargs), first=not self._early,
                          last=False)
            self._early.update(id(x) for _, x in part)

    def remove(self) -> None:
        if self.optimizer.__dict__.get("step") is not self:
            raise RuntimeError(f"{type(self.optimizer).__name__}.step was replaced after the out-of-core store"
                               " installed its layer-by-layer step; refusing to overwrite it")
        if self._previous is _MISSING:
            del self.optimizer.__dict__["step"]
        else:
            self.optimizer.__dict__["step"] = self._previous


def why_not(optimizer: Optimizer) -> Optional[str]:
    """Why the streamed step cannot step ``optimizer``, or None: LBFGS, or any step that needs the closure, evaluates
    forward and backward again inside its step and moves all parameters along one direction of the whole model,
    where the streamed step runs the closure once and then steps one unit at a time, each unit's state in memory
    only for its own step."""
    if not (isinstance(optimizer, LBFGS) or _needs_closure(type(optimizer).step)):
        return None
    name = type(optimizer).__name__
    return ("its step needs the closure (it may evaluate forward and backward again inside the step, as LBFGS does),"
            " while the out-of-core store runs the closure once and then steps the parameters layer by layer,"
            f" streaming each layer's state in and out. Use state_store=None with {name}, or an optimizer that steps"
            " each parameter on its own (SGD, Adam, AdamW, ...) with the store")


def _needs_closure(step: Callable[..., Any]) -> bool:
    try:
        closure = inspect.signature(step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read (a builtin): torch's optimizers all have one
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def backward_step_conflicts(trainer: Any, optimizers: list[Any], precision: Any) -> list[str]:
    """What keeps this fit's optimizer step out of backward (empty: nothing): whatever needs the whole gradient
    before the step, or runs between backward and the step."""
    import lightning.pytorch as pl

    module = trainer.lightning_module
    out = []
    if len(optimizers) != 1:
        out.append(f"{len(optimizers)} optimizers")
    if trainer.world_size > 1:
        out.append(f"{trainer.world_size} ranks (the gradients are averaged when backward is over)")
    if not module.automatic_optimization:
        out.append("manual optimization")
    if trainer.gradient_clip_val:
        out.append(f"Trainer(gradient_clip_val={trainer.gradient_clip_val})")
    if isinstance(precision, HorizonPrecision) and precision.steps_itself:
        out.append(f"{type(precision).__name__}(mode={precision.mode!r}, master={precision.master!r}) (its own step)")
    if getattr(precision, "backend", "native") != "native":
        out.append(f"{type(precision).__name__}(backend={precision.backend!r})")
    for opt in optimizers:  # a pre-hook would run in backward, before the other units' gradients exist
        opt = torch_optimizer(opt)
        if opt._optimizer_step_pre_hooks or _global_optimizer_pre_hooks:
            out.append(f"a step pre-hook on {type(opt).__name__} (register_step_pre_hook)")
    hooks = ("on_after_backward", "on_before_optimizer_step")
    for hook in (*hooks, "configure_gradient_clipping"):
        if getattr(type(module), hook) is not getattr(pl.LightningModule, hook):
            out.append(f"{type(module).__name__}.{hook}")
    for cb in trainer.callbacks:
        out.extend(f"{type(cb).__name__}.{hook}" for hook in hooks
                   if getattr(type(cb), hook) is not getattr(pl.Callback, hook))
    return out


__all__ = ["StreamedStep", "backward_step_conflicts", "why_not"]
