"""Which optimizers can step node-sharded state: those whose update of a parameter reads only that parameter's
gradient and state. Each rank then steps the parameters it owns and skips the others (their ``grad`` is None),
exactly as the replicated run would have stepped them."""

from __future__ import annotations

from typing import Any

import torch

from lightning_horizon.optim import torch_optimizer

#: torch's per-parameter optimizers (each parameter's update depends on its own gradient and state only)
PER_PARAMETER = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD",
                 "Adafactor")
    if hasattr(torch.optim, name)
)


def check_optimizers(optimizers: list[Any]) -> None:
    """Raise ``ValueError`` naming the first optimizer whose update is not per parameter (or is not known to be)."""
    for opt in optimizers:
        opt = torch_optimizer(opt)
        if not isinstance(opt, PER_PARAMETER):
            raise ValueError(
                f"HorizonStrategy(state='node_sharded') cannot step {type(opt).__name__}: each rank steps only the"
                " parameters it owns, which is exact for optimizers whose update of a parameter reads only its own"
                f" gradient and state; allowed are {', '.join(c.__name__ for c in PER_PARAMETER)}."
                " Use state='replicated' with this optimizer"
            )


__all__ = ["PER_PARAMETER", "check_optimizers"]
