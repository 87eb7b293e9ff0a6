"""The torch optimizer behind Lightning's wrapper, and stepping it one slice of its parameters at a time, as if it
were one step.

``torch_optimizer``: Lightning hands hooks and strategies a ``LightningOptimizer``; what holds the param groups and
the state is the torch optimizer it wraps (``.optimizer``).

Kahan's bounded-memory step (chunks of at most ``step_chunk_numel`` elements) and the out-of-core store's
layer-by-layer step both restrict the param groups to a part, call ``step`` and move on. Per-parameter optimizers
(every torch one on CPU, where ``foreach`` is off by default) compute the same values either way. The
optimizer's step hooks (its own and torch's global ones) still fire once per step: the pre-hooks with the first
part, the post-hooks with the last.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Sequence

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_post_hooks as _global_post_hooks
from torch.optim.optimizer import _global_optimizer_pre_hooks as _global_pre_hooks

ParamSlice = Sequence[tuple[int, Tensor]]  # (param group index, parameter)


def torch_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer itself: ``optimizer`` if it is one, the one a ``LightningOptimizer`` wraps otherwise."""
    return getattr(optimizer, "optimizer", optimizer)


def step_in_parts(optimizer: Optimizer, parts: Sequence[Any], step: Callable[[Any], Any], first: bool = True,
                  last: bool = True) -> Any:
    """Call ``step(part)`` for each part with every param group emptied (``step`` fills the groups with what it
    steps); the groups, hooks and all, are restored afterwards. Returns the last call's result. ``first`` /
    ``last``: these parts begin / end the step (the pre-hooks fire with the first part, the post-hooks with the
    last: the optimizer's own and torch's global ones); a step made of several calls passes ``False`` for the
    calls in between."""
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    pre, post = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    global_pre, global_post = dict(_global_pre_hooks), dict(_global_post_hooks)
    out = None
    try:
        for c, part in enumerate(parts):
            begins, ends = first and c == 0, last and c == len(parts) - 1
            optimizer._optimizer_step_pre_hooks = pre if begins else OrderedDict()
            optimizer._optimizer_step_post_hooks = post if ends else OrderedDict()
            _set(_global_pre_hooks, global_pre if begins else {})
            _set(_global_post_hooks, global_post if ends else {})
            for g in groups:
                g["params"] = []
            out = step(part)
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = pre, post
        _set(_global_pre_hooks, global_pre)
        _set(_global_post_hooks, global_post)
        for g, params in zip(groups, saved):
            g["params"] = params
    return out


def _set(hooks: OrderedDict, entries: dict) -> None:
    """Torch's global hook dict, the same object (the handles that remove a hook hold it), with ``entries``."""
    hooks.clear()
    hooks.update(entries)


__all__ = ["ParamSlice", "step_in_parts", "torch_optimizer"]
