"""Parameters that get no gradient: DDP's reducer refuses them unless told; with one process nothing does, so the
strategy warns after the first step, naming them and the switch that several processes will need."""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.utilities.exceptions import _augment_message
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_horizon.parts import Part

#: DDPStrategy's explanation of the reducer's error, naming this strategy's switch
UNUSED_PARAMETERS = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by"
    " training_step. If this is intentional, you must enable the detection of unused parameters in DDP, either by"
    " setting the string value `strategy='horizon_find_unused_parameters_true'` or by setting the flag in the"
    " strategy with `strategy=HorizonStrategy(find_unused_parameters=True)`."
)
#: what the reducer's error says, matched to add the explanation
REDUCER_ERROR = ".*Expected to have finished reduction in the prior iteration.*"


def explain_unused(exception: BaseException) -> None:
    """Add :data:`UNUSED_PARAMETERS` to DDP's reducer error (as DDPStrategy does, naming this strategy's switch)."""
    _augment_message(exception, pattern=REDUCER_ERROR, new_message=UNUSED_PARAMETERS)


class UnusedParameters(Part):
    """The part that warns once, after the first optimizer step of a one-process fit (DDP's reducer is not there to
    refuse), about the parameters that optimizer steps that got no gradient."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module: Optional[torch.nn.Module] = module

    def optimizer_stepped(self, optimizer: Any) -> None:
        if self.module is not None:
            warn_unused_parameters(optimizer, self.module)
            self.module = None


def warn_unused_parameters(optimizer: Any, module: torch.nn.Module) -> None:
    """Warn (one process, after the first step) about parameters this optimizer steps that got no gradient."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))  # DDP's: no gradient expected there
    unused = [n for n, p in module.named_parameters()
              if id(p) in stepped and p.requires_grad and p.grad is None and n not in ignored]
    if unused and len(unused) < len(stepped):  # none at all: a skipped step, not unused parameters
        rank_zero_warn(
            f"HorizonStrategy: {len(unused)} parameter(s) got no gradient in the first step ({', '.join(unused[:3])}"
            f"{', ...' if len(unused) > 3 else ''}). Harmless with one process; with several, DDP refuses them: pass"
            " `HorizonStrategy(find_unused_parameters=True)` there."
        )


__all__ = ["REDUCER_ERROR", "UNUSED_PARAMETERS", "UnusedParameters", "explain_unused", "warn_unused_parameters"]
