"""What both bf16-true policies share: bf16 module weights, the forward in bf16 or on fp32 copies, the optimizer
wrapped so that a master (fp32 or Kahan) is what it steps, and a checkpoint that carries the full-precision
weights."""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

from lightning_horizon.precision.policy import STATE_VERSION, Policy, default_dtype, per_element


class Bf16TruePolicy(Policy):
    """bf16 weights with a master; subclasses say what the master is (:meth:`register`) and how a step uses it."""

    master = ""  # "fp32" or "kahan": what the checkpoint records

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots: list[tuple[Module, str]] = []  # where the fp32-compute forward swaps in upcast weights
        self._upcasting = False
        self._load_hooked: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
        self._loading: "weakref.WeakKeyDictionary[Optimizer, dict]" = weakref.WeakKeyDictionary()

    @property
    def precision(self) -> str:
        return "bf16-true"

    # ------------------------------------------------------------------ setup

    def convert_module(self, module: Module) -> None:
        self.training_state.to_dtype(module.parameters(), torch.bfloat16)  # same Parameter objects, ties kept

    def connect(self, module: Module, optimizers: list[Optimizer], names: dict[Tensor, str]) -> None:
        super().connect(module, optimizers, names)
        if self.compute == "bf16":  # bf16 activations meet bf16 buffers (HalfPrecision does the same)
            for b in module.buffers():
                if b.is_floating_point():
                    # a buffer is module state, not a weight: no master, no store file, no shared copy, never
                    # stepped or averaged, so not the training state's; ``.data`` keeps the buffer objects that DDP
                    # listed at wrap time for its broadcasts
                    b.data = b.data.to(torch.bfloat16)
        else:
            self._slots = [(m, n) for m in module.modules() for n, p in m._parameters.items() if p is not None]
        for opt in optimizers:
            self.wrap_optimizer(opt)

    def wrap_optimizer(self, opt: Optimizer) -> None:
        """Refuse what bf16-true cannot drive, then give each bf16 parameter its master (:meth:`register`)."""
        if isinstance(opt, LBFGS):
            raise ValueError(
                "HorizonPrecision(mode='bf16-true') cannot wrap LBFGS (it re-evaluates the closure inside step);"
                " use mode='bf16-mixed' or another optimizer"
            )
        own = _own_parameter_list(opt, set(map(id, self.names)))
        if own is not None:
            raise ValueError(
                f"HorizonPrecision(mode='bf16-true') cannot drive the optimizer {type(opt).__name__}: it keeps its"
                f" own list of the parameters ({type(opt).__name__}.{own}) instead of reading param_groups at each"
                " step, so the fp32 / Kahan master it must step would never move; use mode='bf16-mixed' with it"
            )
        for group in opt.param_groups:
            for p in group["params"]:
                if p not in self.names:
                    raise ValueError(
                        f"HorizonPrecision(mode='bf16-true'): the optimizer {type(opt).__name__} holds a tensor of"
                        f" shape {tuple(p.shape)} that is not a parameter of the LightningModule"
                    )
                # integer / frozen-in-other-dtype parameters: stepped as they are; under node-sharded state a rank
                # keeps masters for the parameters it steps only
                if p.dtype == torch.bfloat16 and self.training_state.owns(p):
                    self.register(opt, p)
        if opt not in self._load_hooked:
            opt.register_load_state_dict_pre_hook(self._before_load)
            opt.register_load_state_dict_post_hook(self._after_load)
            self._load_hooked.add(opt)

    def _before_load(self, opt: Optimizer, state_dict: dict[str, Any]) -> None:
        self._loading[opt] = state_dict

    def _after_load(self, opt: Optimizer) -> None:
        """torch's load casts every floating state tensor but ``step`` to its parameter's dtype, here bf16: state that
        is not per element (ASGD's fp32 ``eta`` and ``mu``, Adafactor's factored variances) gets back the dtype it
        was saved with, so that a resume is bitwise. Per-element state keeps the dtype the policy holds it in."""
        saved = self._loading.pop(opt, None)
        if saved is None:
            return
        ids = [i for g in saved["param_groups"] for i in g["params"]]
        params = [p for g in opt.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            state = opt.state.get(p)
            for k, v in saved["state"].get(i, {}).items():
                x = state.get(k) if state is not None else None
                if (isinstance(v, Tensor) and isinstance(x, Tensor) and v.is_floating_point()
                        and x.dtype != v.dtype and not per_element(k, v, p)):
                    state[k] = v.to(x.device, copy=True)

    def register(self, opt: Optimizer, p: Tensor) -> None:
        """Give the bf16 parameter ``p`` of ``opt`` its master in the training state (keeping a matching one)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ forward

    def forward_context(self) -> Any:
        return self._bf16_forward() if self.compute == "bf16" else self._upcast_weights()

    @contextmanager
    def _bf16_forward(self) -> Generator[None, None, None]:
        # bf16 is the default dtype inside the step, as in Lightning's own "bf16-true"
        with default_dtype(torch.bfloat16), self.autocast():
            yield

    def recompute_context(self, module: Module) -> Any:
        """The bf16 default dtype, and under fp32 compute the fp32 copies of ``module``'s own parameters only
        (autocast itself is restored by ``torch.utils.checkpoint``)."""
        if self.compute == "fp32":
            mine = {id(m) for m in module.modules()}
            return self._upcast_weights([(m, n) for m, n in self._slots if id(m) in mine])
        return default_dtype(torch.bfloat16)

    @contextmanager
    def _upcast_weights(self, slots: Optional[list[tuple[Module, str]]] = None) -> Generator[None, None, None]:
        """Swap each bf16 parameter for a differentiable fp32 copy during the forward: fp32 matmuls, bf16 grads."""
        if self._upcasting:  # nested step contexts: the outer one already swapped
            yield
            return
        casts: dict[Tensor, Tensor] = {}  # one copy per parameter: tied weights stay tied
        swapped = []
        for mod, name in self._slots if slots is None else slots:
            p = mod._parameters[name]
            if p is None or p.dtype != torch.bfloat16:
                continue
            if p not in casts:
                casts[p] = p.float()
            mod._parameters[name] = casts[p]  # plain dict write: state_dict keys and hooks stay untouched
            swapped.append((mod, name, p))
        self._upcasting = True
        try:
            yield
        finally:
            self._upcasting = False
            for mod, name, p in reversed(swapped):
                mod._parameters[name] = p

    def convert_input(self, data: Any) -> Any:
        if self.compute == "bf16":
            return _map_float_tensors(data, lambda t: t.to(torch.bfloat16))
        return data

    # ------------------------------------------------------------------ optimizer step

    owns_step = True  # subclasses' step(): the masters from the bf16 parameters' gradients, the weights from them

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        state = self.training_state
        return {
            "version": STATE_VERSION,
            "mode": "bf16-true",
            "master": self.master,
            "masters": {n: m.detach() for p, n in self.names.items() if (m := state.master(p)) is not None},
            "compensation": {n: c for p, n in self.names.items() if (c := state.compensation(p)) is not None},
            "rng": self.rng_state(),
        }


def _own_parameter_list(optimizer: Optimizer, params: set[int]) -> Optional[str]:
    """The attribute in which ``optimizer`` keeps parameters outside its param groups (``None`` when it does not):
    such an optimizer steps its own list and never sees what bf16-true puts in the groups for the step."""

    def holds(value: Any, depth: int) -> bool:
        if isinstance(value, Tensor):
            return id(value) in params
        if isinstance(value, Optimizer):  # a wrapped optimizer (ZeroRedundancyOptimizer.optim)
            return value is not optimizer
        if depth and isinstance(value, dict):
            return any(holds(k, depth - 1) or holds(v, depth - 1) for k, v in value.items())
        if depth and isinstance(value, (list, tuple, set, frozenset)):
            return any(holds(v, depth - 1) for v in value)
        return False

    for name, value in vars(optimizer).items():
        if name not in ("param_groups", "state", "defaults") and holds(value, 3):
            return name
    return None


def _map_float_tensors(data: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(data, Tensor):
        return fn(data) if data.is_floating_point() else data
    if isinstance(data, (list, tuple)) and not hasattr(data, "_fields"):
        return type(data)(_map_float_tensors(x, fn) for x in data)
    if isinstance(data, dict):
        return type(data)((k, _map_float_tensors(v, fn)) for k, v in data.items())
    return data
