"""Memory estimates: what training holds now, per parameter, and what it will take but has not allocated yet.

``held_bytes`` measures the live tensors (weights, masters or compensation, grads, optimizer state) and
``bytes_per_param`` is its analytic counterpart per precision mode. torch allocates gradients at the first
backward and optimizer state at the first step, so at setup (the fit check) and before the first plan (the
sharder) they are not resident yet: ``optimizer_state_pending`` and ``gradients_pending`` foresee them from the
module's parameters and the optimizers.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer


def state_tensors(optimizer: Any) -> int:
    """Per-element state tensors ``optimizer`` keeps per parameter: 2 for the Adam family (two moments), 1 for SGD
    with momentum and RMSprop, 0 for plain SGD, 2 for anything else (a conservative guess that a first re-plan
    corrects)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps the torch one
    name = type(opt).__name__
    if name == "SGD":
        return 1 if any(g.get("momentum", 0) for g in opt.param_groups) else 0
    return 1 if name == "RMSprop" else 2


def optimizer_state_pending(optimizers: Any, owns: Optional[Callable[[Tensor], bool]] = None) -> int:
    """Bytes of optimizer state not allocated yet (torch optimizers allocate it lazily, at their first step):
    :func:`state_tensors` per parameter byte, for the parameters this rank steps (``owns``; all by default)."""
    total, seen = 0, set()
    for opt in optimizers or ():
        opt = getattr(opt, "optimizer", opt)
        factor = state_tensors(opt)
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in seen or opt.state.get(p) or (owns is not None and not owns(p)):
                    continue
                seen.add(id(p))
                total += factor * p.numel() * p.element_size()
    return total


def gradients_pending(optimizers: Any, owns: Optional[Callable[[Tensor], bool]] = None) -> int:
    """Bytes of gradients not allocated yet: one per trainable parameter byte whose ``.grad`` is still None (of the
    parameters whose gradients this rank keeps, ``owns``; all by default)."""
    total, seen = 0, set()
    for opt in optimizers:
        for group in getattr(opt, "optimizer", opt).param_groups:  # LightningOptimizer wraps the torch one
            for p in group["params"]:
                if owns is not None and not owns(p):
                    continue
                if p.requires_grad and p.grad is None and id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
    return total




def held_bytes(module: Module, optimizers: list[Optimizer], precision: Any = None) -> dict[str, int]:
    """Bytes the weights, master copies / compensation, gradients and optimizer state occupy now (shared storage
    counted once). Call it after a step, before ``zero_grad``, to see everything a training step holds."""
    seen: set[int] = set()

    def nbytes(tensors: Any) -> int:
        total = 0
        for t in tensors:
            if isinstance(t, Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    params = list(module.parameters())
    opt_params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    state = getattr(precision, "training_state", None)
    extra = state.extra_tensors() if state is not None else []
    out = {"weights": nbytes(params), "master": nbytes(extra + opt_params)}
    out["grads"] = nbytes(p.grad for p in params + opt_params)
    out["state"] = nbytes(v for opt in optimizers for st in opt.state.values() for v in st.values())
    out["total"] = sum(out.values())
    return out


def bytes_per_param(mode: str, master: Optional[str] = None, state_tensors: int = 2) -> dict[str, int]:
    """Bytes held per parameter between steps (weights, master or compensation, grads, optimizer state).

    ``state_tensors`` is the optimizer's per-element state tensors (AdamW: 2, SGD with momentum: 1). The
    ``"fp32"`` mode is plain fp32 training (Lightning's ``"32-true"``).
    """
    if mode in ("fp32", "auto", "bf16-mixed"):
        parts = {"weights": 4, "master": 0, "grads": 4, "state": 4 * state_tensors}
    elif master == "fp32":  # fp32 grads exist inside the optimizer step only
        parts = {"weights": 2, "master": 4, "grads": 2, "state": 4 * state_tensors}
    else:
        parts = {"weights": 2, "master": 2, "grads": 2, "state": 2 * state_tensors}
    parts["total"] = sum(parts.values())
    return parts


__all__ = ["bytes_per_param", "gradients_pending", "held_bytes", "optimizer_state_pending", "state_tensors"]
