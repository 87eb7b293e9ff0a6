"""Clipping under node-sharded state: by the norm of the whole gradient, by value on the share a rank holds.

Each rank holds the gradients of the parameters it owns, so a norm taken on one rank is its share's. Lightning
routes every clip through the precision plugin: ``Trainer(gradient_clip_val=...)`` and ``self.clip_gradients(...)``
(from ``configure_gradient_clipping`` or in manual optimization) end in ``clip_grad_by_norm`` or
``clip_grad_by_value``. HorizonPrecision's ``clip_grad_by_norm`` takes the norm from the training state, summed over
the shards; for any other plugin :func:`clip` does the same, as the part's ``clip_gradients`` hook (parts.py).
Clipping by value is per element: every share clips alike as it is, and a rank that holds none of an optimizer's
gradients has nothing to clip (torch's ``clip_grad_value_`` raises on an empty list, so the plugin's is called only
where there is a gradient). A call to ``torch.nn.utils.clip_grad_norm_`` in the LightningModule cannot be reached
from here; :func:`warn_direct_clipping` names it where the module's source shows it.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.enums import GradClipAlgorithmType

from lightning_horizon.precision import HorizonPrecision
from lightning_horizon.state import TrainingState

#: the LightningModule hooks that run between backward and the step, where a user clips
HOOKS = ("training_step", "on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")
_DIRECT = re.compile(r"\bclip_grad_norm_?\s*\(")


def clip(plugin: Any, training_state: TrainingState, optimizer: Any, clip_val: float, algorithm: Any) -> bool:
    """The node-sharded part of a clip (the ``clip_gradients`` hook of the parts contract): True when done here.

    By norm: the norm over every rank's share (``TrainingState.grad_norm``); HorizonPrecision's own
    ``clip_grad_by_norm`` already takes it there (and records it), so it clips. By value, per element: every share
    clips alike as it is, through the plugin's own; a rank that holds none of the optimizer's gradients has nothing
    to clip."""
    params = list(plugin.main_params(optimizer))
    if algorithm == GradClipAlgorithmType.VALUE:
        return not any(p.grad is not None for p in params)
    if isinstance(plugin, HorizonPrecision):
        return False
    training_state.clip(params, clip_val, training_state.grad_norm(params))
    return True


def warn_direct_clipping(module: Any) -> None:
    """Warn when one of the module's own step hooks calls ``clip_grad_norm_`` itself (its norm would be this rank's
    share's, not the whole gradient's)."""
    for name in HOOKS:
        fn = getattr(type(module), name, None)
        if fn is None or getattr(fn, "__module__", "").startswith("lightning."):
            continue
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):  # no source (compiled, interactive): nothing to say
            continue
        if _DIRECT.search(source):
            rank_zero_warn(
                f"HorizonStrategy(state='node_sharded'): {type(module).__name__}.{name} calls"
                " torch.nn.utils.clip_grad_norm_ itself; each rank holds only the gradients it owns, so that norm is"
                " its share's and every rank clips differently from a replicated run. Clip with"
                " self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm='norm') (or"
                " Trainer(gradient_clip_val=...)): its norm is the whole gradient's"
            )
            return
