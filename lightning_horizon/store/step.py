"""The optimizer step, one layer at a time: the out-of-core store's replacement for ``optimizer.step``.

Installed as an instance attribute of the torch optimizer (what Lightning, the precision plugins and a scheduler's
step counter call), it runs the closure once, as torch does, then steps the parameters unit by unit
(:func:`lightning_horizon.optim_parts.step_in_parts`): while one unit steps, the next one's files (weights,
gradients, masters, optimizer state) are read in on the reading thread; after it, its state moves into the store and
the unit is written back and leaves memory. Each unit's state is read and written once per step. Per-parameter
optimizers compute exactly what one whole step computes. Parameters the store does not hold (Kahan's fp32
proxies, which its own chunked step settles) step together, in one call.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_horizon.optim_parts import Part, step_in_parts
from lightning_horizon.state import TrainingState
from lightning_horizon.store.store import StateStore

_MISSING = object()


class StreamedStep:
    """``optimizer.step`` one unit at a time; :meth:`remove` puts the previous ``step`` back."""

    def __init__(self, optimizer: Optimizer, store: StateStore, training_state: TrainingState) -> None:
        self.optimizer, self.store, self.training_state = optimizer, store, training_state
        self._previous = optimizer.__dict__.get("step", _MISSING)  # a scheduler's step counter wraps it so
        self._original = optimizer.step
        if hasattr(self._original, "_wrapped_by_lr_sched"):  # it still counts the steps a scheduler checks for
            self._wrapped_by_lr_sched = True
        optimizer.step = self  # type: ignore[method-assign]

    def parts(self) -> list[Part]:
        """(group, parameter) pairs with a gradient, by unit in the store's order; unknown ones last, together."""
        by_unit: dict[int, list[tuple[int, Tensor]]] = {}
        for i, g in enumerate(self.optimizer.param_groups):
            for x in g["params"]:
                if x.grad is not None:
                    u = self.store.unit_of.get(id(self.training_state.parameter_of(x)))
                    by_unit.setdefault(u.index if u is not None else len(self.store.units), []).append((i, x))
        return [by_unit[k] for k in sorted(by_unit)]

    def __call__(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.store.new_step()
        parts = self.parts()
        if len(parts) <= 1:
            out = self._original(**kwargs)
            self.training_state.settle(self.optimizer, [x for part in parts for _, x in part])
            return loss if closure is not None else out
        units = [self.store.unit_of.get(id(self.training_state.parameter_of(part[0][1]))) for part in parts]

        def step(k: int, part: Part) -> Any:
            if k + 1 < len(parts) and units[k + 1] is not None:
                self.store.prefetch(units[k + 1])
            groups = self.optimizer.param_groups
            for i, x in part:
                groups[i]["params"].append(x)
            out = self._original(**kwargs)
            self.training_state.settle(self.optimizer, [x for _, x in part])
            return out

        numbered = list(enumerate(parts))
        out = step_in_parts(self.optimizer, numbered, lambda kp: step(*kp))
        return loss if closure is not None else out

    def remove(self) -> None:
        if self.optimizer.__dict__.get("step") is not self:
            raise RuntimeError(f"{type(self.optimizer).__name__}.step was replaced after the out-of-core store"
                               " installed its layer-by-layer step; refusing to overwrite it")
        if self._previous is _MISSING:
            del self.optimizer.__dict__["step"]
        else:
            self.optimizer.__dict__["step"] = self._previous


__all__ = ["StreamedStep"]
