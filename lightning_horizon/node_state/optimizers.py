"""Which optimizers can step node-sharded state: those whose update of a parameter reads only that parameter's
gradient and state. Each rank then steps the parameters it owns and skips the others (their ``grad`` is None),
exactly as the replicated run would have stepped them."""

from __future__ import annotations

from typing import Any, Optional

import torch

#: torch's per-parameter optimizers (each parameter's update depends on its own gradient and state only)
PER_PARAMETER = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD",
                 "Adafactor")
    if hasattr(torch.optim, name)
)


def why_not(optimizer: Any) -> Optional[str]:
    """Why node-sharded state cannot step ``optimizer`` (torch's), or None: its update is not per parameter (or is
    not known to be)."""
    if isinstance(optimizer, PER_PARAMETER):
        return None
    return ("each rank steps only the parameters it owns, which is exact for optimizers whose update of a parameter"
            f" reads only its own gradient and state; allowed are {', '.join(c.__name__ for c in PER_PARAMETER)}."
            " Use state='replicated' with this optimizer")


__all__ = ["PER_PARAMETER", "why_not"]
