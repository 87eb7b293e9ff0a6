"""What optimizer state each parameter will have in the store, learned from the optimizer itself at setup.

torch optimizers create their state at the first step, and what they keep depends on the class and on each group's
settings (SGD: a momentum buffer only with momentum; Adam: two moments, three with amsgrad; RMSprop: up to three),
on a user subclass's code, and on tensors created at construction (Adagrad). The store reserves the disk for it at
setup (store/part.py), so it asks the optimizer: one step of a copy of it whose parameters are tiny stand-ins (one
per parameter, of the dtype the step will see, each dimension 1 where the parameter's is and 2 elsewhere, so that a
state shaped like its parameter is told apart from a row or a column of it), with gradients of ones, the hooks left
out and the random generator restored. The copy shares nothing with the optimizer: its parameters, groups, state and
other attributes are its own, so the fit's weights, state and random stream are untouched.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_horizon.precision.policy import per_element
from lightning_horizon.state import TrainingState

#: the optimizer's own bookkeeping a copy starts afresh with (``step``: a scheduler's or the store's wrapper)
_FRESH = ("defaults", "state", "param_groups", "step", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
          "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
          "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")

StateKinds = dict[int, set[tuple[str, torch.dtype]]]


def _stepped_dtype(p: Tensor, training_state: TrainingState) -> torch.dtype:
    """The dtype of the tensor the optimizer steps for ``p``: its fp32 master, Kahan's fp32 proxy, or ``p``."""
    master = training_state.master(p)
    if master is not None:
        return master.dtype
    return torch.float32 if training_state.compensation(p) is not None else p.dtype


def _tiny(t: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.ones(tuple(min(d, 2) for d in t.shape), dtype=dtype)


def state_kinds(optimizer: Any, training_state: TrainingState) -> StateKinds:
    """Per parameter of ``optimizer`` (by id): the (state key, dtype) of each per-element state tensor the store will
    hold for it after a step. Raises ValueError, naming the optimizer, where a step of its copy fails."""
    opt: Optimizer = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps the torch one
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
        raise ValueError(
            f"state_store: cannot learn which state {type(opt).__name__} keeps per parameter (a step of a copy of it"
            f" on small tensors failed: {type(e).__name__}: {e}); the store reserves the disk for that state at"
            " setup. Use an optimizer that can step a copy of itself, or state_store=None"
        ) from e
    out: StateKinds = {}
    for p in params:
        t = tiny[id(p)]
        # Kahan keeps its parameters' state in their own dtype between steps (precision/kahan.py rounds it back)
        keep = p.dtype if training_state.compensation(p) is not None else None
        out[id(p)] = {(k, keep or v.dtype) for k, v in clone.state.get(t, {}).items() if per_element(k, v, t)}
    return out


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
        opt = getattr(optimizer, "optimizer", optimizer)
        keys = sorted({k for g in opt.param_groups for p in g["params"] for k, _ in kinds.get(id(p), ())})
        parts.append(f"{type(opt).__name__}: {', '.join(keys) or 'none'}")
    return "; ".join(parts)


__all__ = ["StateKinds", "describe", "merge", "state_kinds"]
