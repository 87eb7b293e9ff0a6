"""Memory estimates of the precision modes: bytes held now (measured on the live tensors) and bytes per parameter
(analytic). They belong with the other memory questions and will move to ``lightning_horizon/memory/``; import them
from ``lightning_horizon.precision``."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer


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
