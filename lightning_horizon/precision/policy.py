"""The contract of a precision policy: what one mode of HorizonPrecision does, and the helpers the modes share.

HorizonPrecision picks one policy at construction (:func:`lightning_horizon.precision.plugin.choose_policy`) and
delegates to it; the policy owns everything that differs between the modes: how the module's weights are stored,
which context the forward runs in, how the optimizer steps, what a checkpoint holds. The base class is the
plainest mode, fp32 weights that are their own truth; bf16-mixed is it plus autocast.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Generator, Optional

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_horizon.state import TrainingState

STATE_VERSION = 1  # of the checkpoint dict the bf16-true policies write


class Policy:
    """One precision mode. Subclasses override what their mode does differently."""

    #: ``ipex.optimize`` may rewrite the module and optimizer (it expects fp32 weights that the optimizer owns)
    ipex_compatible = False

    def __init__(self, training_state: TrainingState) -> None:
        #: where the true weights live; a policy with masters or compensations registers them here
        self.training_state = training_state
        self.names: dict[Tensor, str] = {}  # module parameter -> its state_dict name (set by connect)
        self.compute = "fp32"  # "bf16" or "fp32", resolved from the ISA by the plugin (set_compute)
        self.device_type = "cpu"

    def set_compute(self, compute: str, device_type: str) -> None:
        """Where the forward runs and in which dtype the matmuls compute."""
        self.compute, self.device_type = compute, device_type

    @property
    def precision(self) -> str:
        """What ``trainer.precision`` and the model summary report: the arithmetic that really runs."""
        raise NotImplementedError

    def describe(self) -> str:
        """Where weights, grads and optimizer state live, for the one-line dtype policy."""
        raise NotImplementedError

    # ------------------------------------------------------------------ setup

    def convert_module(self, module: Module) -> None:
        """Change the module's parameters to this mode's storage dtype (in place)."""

    def connect(self, module: Module, optimizers: list[Optimizer], names: dict[Tensor, str]) -> None:
        """Take the module and its optimizers over for training (``names``: parameter -> state_dict name)."""
        self.names = names

    # ------------------------------------------------------------------ forward

    def autocast(self) -> Any:
        # autocast also on bf16 weights: CPU autocast runs the losses (cross_entropy, nll, mse) in fp32
        return torch.autocast(self.device_type, dtype=torch.bfloat16, cache_enabled=False)

    def forward_context(self) -> Any:
        return nullcontext()

    def recompute_context(self, module: Module) -> Any:
        """What :meth:`forward_context` established beyond autocast, for a recompute of ``module`` in backward."""
        return nullcontext()

    def convert_input(self, data: Any) -> Any:
        return data

    # ------------------------------------------------------------------ optimizer step

    #: whether the policy runs the optimizer step itself (:meth:`step`); otherwise Lightning's own step runs,
    #: right wherever the optimizer steps the module's parameters themselves
    owns_step = False

    def step(self, optimizer: Optimizer, after_closure: Callable[[], None], kwargs: dict[str, Any]) -> Any:
        """The optimizer step, after forward and backward have run: ``after_closure`` measures the grad norm and
        runs the ``on_before_optimizer_step`` callbacks (only called when :attr:`owns_step`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {}  # the parameters are the whole truth (an empty dict is not written)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the full-precision weights a checkpoint carries (as fp32 masters or bf16 + compensation)."""
        masters, comps = state_dict.get("masters", {}), state_dict.get("compensation", {})
        with torch.no_grad():
            for p, name in self.names.items():
                exact = masters[name].float() if name in masters else None
                if exact is None and name in comps:
                    exact = p.float() + comps[name].float()
                if exact is not None:
                    self.restore(p, exact, comps.get(name))

    def rng_state(self) -> dict[str, Tensor]:
        """The state of the generators the step draws from, per device (none: the step draws nothing)."""
        return {}

    def load_rng_state(self, state: dict[str, Tensor]) -> None:
        """Restore what :meth:`rng_state` returned."""

    def restore(self, param: Tensor, exact: Tensor, compensation: Optional[Tensor]) -> None:
        """Make ``exact`` (fp32; ``compensation`` when the checkpoint saved one) the true value of ``param``."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------- shared helpers


@contextmanager
def default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def per_element(key: Any, value: Any, p: Tensor) -> bool:
    """Optimizer state that has one entry per parameter element (moments, buffers); not ``step`` or scalars."""
    return (key != "step" and isinstance(value, Tensor) and value.is_floating_point() and value.dim() > 0
            and value.shape == p.shape)


def cast_state(state: dict[str, Any], p: Tensor, dtype: torch.dtype) -> dict[str, Any]:
    return {k: v.to(dtype) if per_element(k, v, p) else v for k, v in state.items()}
