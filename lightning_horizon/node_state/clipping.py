"""Clipping by norm under node-sharded state: the norm of the whole gradient, whatever path asks for it.

Each rank holds the gradients of the parameters it owns, so a norm taken on one rank is its share's. Lightning
routes every clip through the precision plugin: ``Trainer(gradient_clip_val=...)`` and ``self.clip_gradients(...)``
(from ``configure_gradient_clipping`` or in manual optimization) end in ``clip_grad_by_norm``. HorizonPrecision's
takes the norm from the training state, summed over the shards; for any other plugin :class:`GlobalNormClip`
gives the plugin, for the fit, a ``clip_grad_by_norm`` that does the same. Clipping by value is per element: every
share clips alike as it is. A call to ``torch.nn.utils.clip_grad_norm_`` in the LightningModule cannot be reached
from here; :func:`warn_direct_clipping` names it where the module's source shows it.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_horizon.state import TrainingState

#: the LightningModule hooks that run between backward and the step, where a user clips
HOOKS = ("training_step", "on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")
_DIRECT = re.compile(r"\bclip_grad_norm_?\s*\(")


class GlobalNormClip:
    """``plugin.clip_grad_by_norm`` for the fit: the norm over every rank's share (``TrainingState.grad_norm``)."""

    def __init__(self, plugin: Any, training_state: TrainingState) -> None:
        self.plugin, self.training_state = plugin, training_state
        self._installed = False

    def install(self) -> None:
        if getattr(self.plugin, "training_state", None) is self.training_state:
            return  # HorizonPrecision: its own clip_grad_by_norm already asks the training state
        self.plugin.clip_grad_by_norm = self.clip_grad_by_norm  # this instance only, until teardown
        self._installed = True

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        params = list(self.plugin.main_params(optimizer))
        self.training_state.clip(params, clip_val, self.training_state.grad_norm(params))

    def uninstall(self) -> None:
        if self._installed:
            del self.plugin.clip_grad_by_norm  # the class's method again
            self._installed = False


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
