"""What per-element state an optimizer will keep for each parameter, learned from the optimizer itself.

torch optimizers create their state at the first step, and what they keep depends on the class and on each group's
settings (SGD: a momentum buffer only with momentum; Adam: two moments, three with amsgrad; RMSprop: up to three),
on a user subclass's code, and on tensors created at construction (Adagrad). No table of classes can know it, so
this asks the optimizer: one step of a copy of it whose parameters are tiny stand-ins (one per parameter, of the
dtype the step will see, each dimension 1 where the parameter's is and 2 elsewhere, so that a state shaped like its
parameter is told apart from a row or a column of it), with gradients of ones, the hooks left out and the random
generator restored. The copy shares nothing with the optimizer: its parameters, groups, state and other attributes
are its own, so the fit's weights, state and random stream are untouched.

The memory estimates (``estimate.py``: the fit check at setup, the sharder's plan) and the out-of-core store's disk
reservation (``store/reserve.py``) count what this finds.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_horizon.optim import torch_optimizer
from lightning_horizon.precision.policy import per_element

if TYPE_CHECKING:
    from lightning_horizon.state import TrainingState

#: the optimizer's own bookkeeping a copy starts afresh with (``step``: a scheduler's or the store's wrapper)
_FRESH = ("defaults", "state", "param_groups", "step", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
          "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
          "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")

#: per parameter (by id): the (state key, dtype) of each per-element state tensor it will have after a step
StateKinds = dict[int, set[tuple[str, torch.dtype]]]


class OptimizerStateUnknown(ValueError):
    """A step of a copy of the optimizer failed, so its state cannot be learned; the cause is ``__cause__``."""


def _stepped_dtype(p: Tensor, training_state: Optional[TrainingState]) -> torch.dtype:
    """The dtype of the tensor the optimizer steps for ``p``: its fp32 master, Kahan's fp32 proxy, or ``p``."""
    if training_state is None:
        return p.dtype
    master = training_state.master(p)
    if master is not None:
        return master.dtype
    return torch.float32 if training_state.compensation(p) is not None else p.dtype


def _tiny(t: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.ones(tuple(min(d, 2) for d in t.shape), dtype=dtype)


def state_kinds(optimizer: Any, training_state: Optional[TrainingState] = None) -> StateKinds:
    """Per parameter of ``optimizer`` (by id): the (state key, dtype) of each per-element state tensor it will hold
    for it after a step, with the masters and Kahan compensation of ``training_state`` (none by default). Raises
    :class:`OptimizerStateUnknown`, naming the optimizer, where a step of its copy fails."""
    opt: Optimizer = torch_optimizer(optimizer)
    params = list(dict.fromkeys(p for g in opt.param_groups for p in g["params"]))
    stepped = {id(p): _stepped_dtype(p, training_state) for p in params}
    tiny = {id(p): _tiny(p, stepped[id(p)]).requires_grad_(p.requires_grad) for p in params}
    clone = object.__new__(type(opt))
    memo: dict[int, Any] = {id(opt): clone, **{id(p): tiny[id(p)] for p in params}}
    try:
        state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        for p, st in opt.state.items():  # state made at construction (Adagrad's sums), small
            if id(p) not in tiny:
                continue
            # a master or a proxy steps with its state in its own dtype (fp32), as the precision casts it
            cast = stepped[id(p)] if stepped[id(p)] != p.dtype else None
            state[tiny[id(p)]] = {k: _tiny(v, cast or v.dtype) if per_element(k, v, p) else copy.deepcopy(v, memo)
                                  for k, v in st.items()}
        clone.__dict__.update(copy.deepcopy({k: v for k, v in vars(opt).items() if k not in _FRESH}, memo))
        clone.__setstate__({  # torch's own way to rebuild an optimizer (pickling): fresh hooks
            "defaults": copy.deepcopy(opt.defaults, memo), "state": state,
            "param_groups": [{**copy.deepcopy({k: v for k, v in g.items() if k != "params"}, memo),
                              "params": [tiny[id(p)] for p in g["params"]]} for g in opt.param_groups]})
        for t in tiny.values():
            if t.requires_grad:
                t.grad = torch.ones_like(t)
        step = type(clone).step
        if getattr(step, "hooked", False):  # torch's wrapper that runs the (global) step hooks: not for a copy
            step = step.__wrapped__
        with torch.random.fork_rng(devices=[]):
            step(clone, lambda: torch.zeros(()))
    except Exception as e:
        raise OptimizerStateUnknown(
            f"cannot learn which state {type(opt).__name__} keeps per parameter (a step of a copy of it on small"
            f" tensors failed: {type(e).__name__}: {e})"
        ) from e
    out: StateKinds = {}
    for p in params:
        t = tiny[id(p)]
        # Kahan keeps its parameters' state in their own dtype between steps (precision/kahan.py rounds it back)
        keep = p.dtype if training_state is not None and training_state.compensation(p) is not None else None
        out[id(p)] = {(k, keep or v.dtype) for k, v in clone.state.get(t, {}).items() if per_element(k, v, t)}
    return out


__all__ = ["OptimizerStateUnknown", "StateKinds", "state_kinds"]
