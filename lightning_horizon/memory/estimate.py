"""Memory estimates: what training holds now, per parameter, and what it will take but has not allocated yet.

``held_bytes`` measures the live tensors (weights, masters or compensation, grads, optimizer state) and
``bytes_per_param`` is its analytic counterpart per precision mode. torch allocates gradients at the first
backward and optimizer state at the first step, so at setup (the fit check) and before the first plan (the
sharder) they are not resident yet: ``optimizer_state_pending`` and ``gradients_pending`` foresee them from the
module's parameters and the optimizers; the optimizer state is what a step of a copy of each optimizer creates
(``optimizer_state.py``), not a guess from its class.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_horizon.memory.optimizer_state import OptimizerStateUnknown, StateKinds, state_kinds
from lightning_horizon.optim import torch_optimizer

if TYPE_CHECKING:
    from lightning_horizon.state import TrainingState

#: per-element state tensors counted, like its parameters, for an optimizer that cannot step a copy of itself
UNKNOWN_STATE_TENSORS = 2


def _kinds(opt: Optimizer, training_state: Optional[TrainingState]) -> StateKinds:
    try:
        return state_kinds(opt, training_state)
    except OptimizerStateUnknown as e:  # an estimate, not a refusal: the fit itself may well run
        warnings.warn(f"{e}: the memory estimate counts {UNKNOWN_STATE_TENSORS} tensors like each parameter for"
                      " its state", stacklevel=3)
        return {id(p): set() if opt.state.get(p) else {(f"state{i}", p.dtype) for i in range(UNKNOWN_STATE_TENSORS)}
                for g in opt.param_groups for p in g["params"] if p.requires_grad}


def state_tensors(optimizer: Any, training_state: Optional[TrainingState] = None) -> int:
    """Per-element state tensors ``optimizer`` keeps per parameter after a step (the most any of its parameters
    keeps), as a step of a copy of it shows: 2 for Adam, 3 with amsgrad, 0 for SGD without momentum."""
    opt = torch_optimizer(optimizer)
    return max(map(len, _kinds(opt, training_state).values()), default=0)


def optimizer_state_pending(optimizers: Any, owns: Optional[Callable[[Tensor], bool]] = None,
                            training_state: Optional[TrainingState] = None) -> int:
    """Bytes of optimizer state not allocated yet (torch optimizers allocate it lazily, at their first step): each
    per-element state tensor a step of each optimizer creates and it does not hold yet, in the dtype it will have
    (``training_state``'s masters step in fp32), for the parameters this rank steps (``owns``; all by default). A
    parameter in two optimizers has the state of both."""
    total = 0
    for optimizer in optimizers or ():
        opt = torch_optimizer(optimizer)
        kinds = _kinds(opt, training_state)
        for p in dict.fromkeys(p for g in opt.param_groups for p in g["params"]):
            if owns is not None and not owns(p):
                continue
            held = opt.state.get(p, {})
            total += sum(p.numel() * dtype.itemsize for key, dtype in kinds.get(id(p), ()) if key not in held)
    return total


def gradients_pending(optimizers: Any, owns: Optional[Callable[[Tensor], bool]] = None) -> int:
    """Bytes of gradients not allocated yet: one per trainable parameter byte whose ``.grad`` is still None (of the
    parameters whose gradients this rank keeps, ``owns``; all by default)."""
    total, seen = 0, set()
    for opt in optimizers:
        for group in torch_optimizer(opt).param_groups:
            for p in group["params"]:
                if owns is not None and not owns(p):
                    continue
                if p.requires_grad and p.grad is None and id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
    return total


def held_bytes(module: Module, optimizers: list[Optimizer], precision: Any = None) -> dict[str, int]:
    """Bytes the weights, master copies / compensation, gradients and optimizer state occupy now (shared storage
    counted once; of a sharded DTensor, this rank's shard). Call it after a step, before ``zero_grad``, to see
    everything a training step holds."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()

    def nbytes(tensors: Any) -> int:
        total = 0
        for t in tensors:
            if isinstance(t, DTensor):  # a sharded parameter (FSDP2): this rank's shard
                t = t.to_local()
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
