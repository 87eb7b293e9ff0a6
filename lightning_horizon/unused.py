"""Parameters that get no gradient: DDP's reducer refuses them unless told; with one process nothing does, so the
strategy warns after the first step, naming them and the switch that several processes will need."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

#: DDPStrategy's explanation of the reducer's error, naming this strategy's switch
UNUSED_PARAMETERS = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by"
    " training_step. If this is intentional, you must enable the detection of unused parameters in DDP, either by"
    " setting the string value `strategy='horizon_find_unused_parameters_true'` or by setting the flag in the"
    " strategy with `strategy=HorizonStrategy(find_unused_parameters=True)`."
)
#: what the reducer's error says, matched to add the explanation
REDUCER_ERROR = ".*Expected to have finished reduction in the prior iteration.*"


def warn_unused_parameters(optimizer: Any, module: torch.nn.Module) -> None:
    """Warn (one process, after the first step) about parameters this optimizer steps that got no gradient."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    unused = [n for n, p in module.named_parameters() if id(p) in stepped and p.requires_grad and p.grad is None]
    if unused and len(unused) < len(stepped):  # none at all: a skipped step, not unused parameters
        rank_zero_warn(
            f"HorizonStrategy: {len(unused)} parameter(s) got no gradient in the first step ({', '.join(unused[:3])}"
            f"{', ...' if len(unused) > 3 else ''}). Harmless with one process; with several, DDP refuses them: pass"
            " `HorizonStrategy(find_unused_parameters=True)` there."
        )


__all__ = ["REDUCER_ERROR", "UNUSED_PARAMETERS", "warn_unused_parameters"]
