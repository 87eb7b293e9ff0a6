"""What optimizer state each parameter will have in the store, learned from the optimizer itself at setup.

The store reserves the disk for it at setup (store/part.py): the per-element state tensors a step of a copy of the
optimizer creates (``memory/optimizer_state.py``, the same answer the memory estimates count), in the dtype the store
keeps them in. An optimizer that cannot step a copy of itself is refused by name.
"""

from __future__ import annotations

from typing import Any

from lightning_horizon.memory.optimizer_state import OptimizerStateUnknown, StateKinds
from lightning_horizon.memory.optimizer_state import state_kinds as learn_state_kinds
from lightning_horizon.optim import torch_optimizer
from lightning_horizon.state import TrainingState


def state_kinds(optimizer: Any, training_state: TrainingState) -> StateKinds:
    """Per parameter of ``optimizer`` (by id): the (state key, dtype) of each per-element state tensor the store will
    hold for it after a step. Raises ValueError, naming the optimizer, where a step of its copy fails."""
    try:
        return learn_state_kinds(optimizer, training_state)
    except OptimizerStateUnknown as e:
        raise ValueError(
            f"state_store: {e}; the store reserves the disk for that state at setup. Use an optimizer that can step"
            " a copy of itself, or state_store=None"
        ) from e.__cause__


def merge(kinds: list[StateKinds]) -> StateKinds:
    """Several optimizers' kinds in one (a parameter in two optimizers has the state of both)."""
    out: StateKinds = {}
    for k in kinds:
        for pid, s in k.items():
            out.setdefault(pid, set()).update(s)
    return out


def describe(optimizers: list[Any], kinds: StateKinds) -> str:
    """``"AdamW: exp_avg, exp_avg_sq"`` per optimizer: the per-element state its parameters will have."""
    parts = []
    for optimizer in optimizers:
        opt = torch_optimizer(optimizer)
        keys = sorted({k for g in opt.param_groups for p in g["params"] for k, _ in kinds.get(id(p), ())})
        parts.append(f"{type(opt).__name__}: {', '.join(keys) or 'none'}")
    return "; ".join(parts)


__all__ = ["StateKinds", "describe", "merge", "state_kinds"]
