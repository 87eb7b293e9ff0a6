"""Clipping under node-sharded state: by the norm of the whole gradient, by value on the share a rank holds.

Each rank holds the gradients of the parameters it owns, so a norm taken on one rank is its share's. Lightning
routes every clip through the precision plugin: ``Trainer(gradient_clip_val=...)`` and ``self.clip_gradients(...)``
(from ``configure_gradient_clipping`` or in manual optimization) end in ``clip_grad_by_norm`` or
``clip_grad_by_value``. HorizonPrecision's ``clip_grad_by_norm`` takes the norm from the training state, summed over
the shards; for any other plugin :class:`ShardedClipping` gives the plugin, for the fit, one that does the same.
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

from lightning_horizon.state import TrainingState

#: the LightningModule hooks that run between backward and the step, where a user clips
HOOKS = ("training_step", "on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")
_DIRECT = re.compile(r"\bclip_grad_norm_?\s*\(")


class ShardedClipping:
    """The plugin's clipping for the fit: ``clip_grad_by_norm`` by the norm over every rank's share
    (``TrainingState.grad_norm``), ``clip_grad_by_value`` on the gradients this rank holds, if any."""

    def __init__(self, plugin: Any, training_state: TrainingState) -> None:
        self.plugin, self.training_state = plugin, training_state
        self._installed: list[str] = []

    def install(self) -> None:
        names = ["clip_grad_by_value"]
        if getattr(self.plugin, "training_state", None) is not self.training_state:
            names.append("clip_grad_by_norm")  # HorizonPrecision's own already asks the training state
        for name in names:
            setattr(self.plugin, name, getattr(self, name))  # this instance only, until teardown
        self._installed = names

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        params = list(self.plugin.main_params(optimizer))
        self.training_state.clip(params, clip_val, self.training_state.grad_norm(params))

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        # per element, no collective: a rank owning none of this optimizer's gradients skips it alone
        if any(p.grad is not None for p in self.plugin.main_params(optimizer)):
            type(self.plugin).clip_grad_by_value(self.plugin, optimizer, clip_val)  # the plugin's own

    def uninstall(self) -> None:
        for name in self._installed:
            delattr(self.plugin, name)  # the class's method again
        self._installed = []


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
