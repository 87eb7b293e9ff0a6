"""Estimates of memory that training will take but has not allocated yet.

torch allocates gradients at the first backward and optimizer state at the first step, so at setup (the fit
check) and before the first plan (the sharder) they are not resident yet: these functions foresee them from the
module's parameters and the optimizers.
"""

from __future__ import annotations

from typing import Any


def optimizer_state_pending(optimizers: Any) -> int:
    """Bytes of optimizer state not allocated yet (torch optimizers allocate it lazily, at their first step).

    Per parameter byte: 2 for the Adam family (two moments), 1 for SGD with momentum and RMSprop, 0 for plain
    SGD, 2 for anything else (a conservative guess that a first re-plan corrects).
    """
    total, seen = 0, set()
    for opt in optimizers or ():
        opt = getattr(opt, "optimizer", opt)  # LightningOptimizer wraps the torch one
        name = type(opt).__name__
        if name == "SGD":
            factor = 1 if any(g.get("momentum", 0) for g in opt.param_groups) else 0
        elif name == "RMSprop":
            factor = 1
        else:
            factor = 2
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in seen or opt.state.get(p):
                    continue
                seen.add(id(p))
                total += factor * p.numel() * p.element_size()
    return total


def gradients_pending(optimizers: Any) -> int:
    """Bytes of gradients not allocated yet: one per trainable parameter byte whose ``.grad`` is still None."""
    total, seen = 0, set()
    for opt in optimizers:
        for group in getattr(opt, "optimizer", opt).param_groups:  # LightningOptimizer wraps the torch one
            for p in group["params"]:
                if p.requires_grad and p.grad is None and id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
    return total


__all__ = ["gradients_pending", "optimizer_state_pending"]
