"""HorizonPrecision, the Lightning precision plugin: validates its arguments, picks one policy, delegates to it.

The modes and what each stores are in the package docstring (``lightning_horizon/precision/__init__.py``) and in
docs/precision.md; each mode's behaviour lives in its own policy (mixed.py, fp32_master.py, kahan.py). What stays
here is common to all modes: the compute dtype resolved from the ISA, the fp32 gradient norm, clipping, the IPEX
backend and applying a checkpoint loaded before setup.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, Optional

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_horizon.checks import check_int, check_one_of, is_int, require
from lightning_horizon.cpu import resolve_compute
from lightning_horizon.precision.compute import matmul_width
from lightning_horizon.precision.fp32_master import FP32MasterPolicy
from lightning_horizon.precision.ipex import ipex_optimize
from lightning_horizon.precision.kahan import KahanPolicy
from lightning_horizon.precision.mixed import MixedPolicy
from lightning_horizon.precision.policy import Policy
from lightning_horizon.state import TrainingState

log = logging.getLogger("lightning_horizon.precision")

MODES = ("auto", "bf16-mixed", "bf16-true")
MASTERS = ("kahan", "fp32")  # bf16-true only; None picks "kahan"
COMPUTES = ("auto", "bf16", "fp32")
BACKENDS = ("native", "ipex", "auto")
STATE_ROUNDINGS = ("stochastic", "nearest")


class HorizonPrecision(Precision):
    """bf16 mixed / true precision with fp32 or Kahan masters, an ISA-aware compute dtype and an fp32 grad norm.

    Args:
        mode: ``"bf16-mixed"`` (fp32 weights, grads, state; bf16 autocast), ``"bf16-true"`` (bf16 weights with a
            master), or ``"auto"`` (= ``"bf16-mixed"``: the right choice on any hardware).
        master: bf16-true only: ``"kahan"`` (default; bf16 weights + bf16 compensation, bf16 optimizer state
            between steps) or ``"fp32"`` (an fp32 master copy the optimizer updates, copied back each step).
        compute: ``"auto"`` (bf16 only where it runs in hardware and the model's matmuls are wide enough for it to
            win), ``"bf16"`` or ``"fp32"`` (force).
        backend: ``"native"`` (torch), ``"ipex"`` or ``"auto"`` (``ipex.optimize`` when it imports, matches
            torch and the step computes in bf16; otherwise native, with a message). Applies to bf16-mixed;
            bf16-true manages its own weights.
        state_rounding: kahan only: how the optimizer state is rounded to bf16 between steps. ``"stochastic"``
            (default, seeded, resumes exactly) keeps slow averages such as Adam's ``exp_avg_sq`` (beta2=0.999)
            unbiased; ``"nearest"`` freezes them once a step's change is below bf16's half-ulp.
        step_chunk_numel: kahan only: the optimizer steps on at most this many elements at a time, so the fp32
            temporaries of the step stay bounded (16 B per element for AdamW). Step hooks still run once per step.
        seed: kahan only: seed of the stochastic-rounding generator (the same on every rank keeps replicas equal).
    """

    def __init__(
        self,
        mode: str = "auto",
        master: Optional[str] = None,
        compute: str = "auto",
        backend: str = "native",
        *,
        state_rounding: str = "stochastic",
        step_chunk_numel: int = 1 << 22,
        seed: int = 0,
    ) -> None:
        _check_arguments(mode, master, compute, backend, state_rounding, step_chunk_numel, seed)
        self.requested_mode = mode
        self.mode = "bf16-mixed" if mode == "auto" else mode
        self.master = (master or "kahan") if self.mode == "bf16-true" else None
        self.requested_compute = compute
        self.backend = backend
        self.state_rounding = state_rounding
        self.step_chunk_numel = step_chunk_numel
        self.seed = seed
        #: fp32 0-dim tensor: the global norm of the gradients the step will use, measured before the
        #: ``on_before_optimizer_step`` callbacks, and again (pre-clip) when Lightning clips by norm.
        self.last_grad_norm: Optional[Tensor] = None
        #: the owner of the true weights: the fp32 masters or Kahan compensations are registered there, and
        #: whoever reads, writes or averages weights (local SGD, checkpoints) goes through it. HorizonStrategy hands
        #: its own (:meth:`use_training_state`); under another strategy the plugin keeps this one.
        self.training_state = TrainingState()
        self._policy = choose_policy(self.mode, self.master, self.training_state, state_rounding,
                                     step_chunk_numel, seed)
        self._module: Optional[Module] = None
        self._resolve_compute()
        self._pending: Optional[dict[str, Any]] = None  # state loaded before connect()
        self._said: Optional[str] = None  # the policy line last logged

    def _resolve_compute(self) -> None:
        """The compute dtype and its reason, from the ISA of the device the model is on (the CPU before there is a
        model) and, once there is one, from how wide its matmuls are."""
        first = next(iter(self._module.parameters()), None) if self._module is not None else None
        device_type = first.device.type if first is not None else "cpu"
        width = matmul_width(self._module) if self._module is not None else None
        compute, self.reason = resolve_compute(self.requested_compute, device_type, width)
        self._policy.set_compute(compute, device_type)

    @property
    def compute(self) -> str:
        """``"bf16"`` or ``"fp32"``: the dtype the matmuls run in, resolved from the ISA and, once the plugin has
        the model (from setup on), from how wide its matmuls are (see :attr:`reason`)."""
        return self._policy.compute

    @property  # type: ignore[override]
    def precision(self) -> str:
        """What ``trainer.precision`` and the model summary report: the arithmetic that really runs."""
        return self._policy.precision

    @property
    def steps_itself(self) -> bool:
        """Whether the optimizer step is this plugin's own (bf16-true: the masters or the Kahan proxies step, the
        bf16 weights follow) rather than the optimizer's plain ``step``."""
        return self._policy.owns_step

    @property
    def policy(self) -> str:
        """The dtype policy in one line (logged once at setup on rank zero)."""
        return f"HorizonPrecision(mode={self.mode!r}): {self._policy.describe()}; {self.reason}"

    # ------------------------------------------------------------------ setup

    def use_training_state(self, state: TrainingState) -> None:
        """Register the true weights in ``state`` from now on (the strategy's, which every part reads); the masters
        and compensations an earlier fit registered move there with their values."""
        if state is not self.training_state:
            state.take_registrations(self.training_state)
            self.training_state = self._policy.training_state = state

    @override
    def convert_module(self, module: Module) -> Module:
        self._module = module
        self._resolve_compute()  # this model's matmul widths: bf16-true's conversion and connect follow it
        self._policy.convert_module(module)
        return module

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        module = self._module if self._module is not None else model
        self._module = module
        self._resolve_compute()
        if rank_zero_only.rank == 0 and self._said != self.policy:  # not again at each validate, test, predict
            log.info(self.policy)
            self._said = self.policy
        self._policy.connect(module, optimizers, {p: n for n, p in module.named_parameters()})
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.load_state_dict(pending)
        if self.backend != "native":
            optimizers = ipex_optimize(module, optimizers, self.backend, self._policy.ipex_compatible,
                                      self.compute)
        return model, optimizers, lr_schedulers

    # ------------------------------------------------------------------ forward

    @override
    def forward_context(self) -> Any:
        return self._policy.forward_context()

    def recompute_context(self, module: Module) -> Any:
        """What :meth:`forward_context` established, re-established for the recompute of one call of ``module``
        (activation recompute runs in backward, after the step's forward context has exited): the bf16 default
        dtype, and under fp32 compute the fp32 copies of ``module``'s own parameters only (autocast itself is
        restored by ``torch.utils.checkpoint``)."""
        return self._policy.recompute_context(module)

    @override
    def convert_input(self, data: Any) -> Any:
        return self._policy.convert_input(data)

    # ------------------------------------------------------------------ optimizer step

    @override
    def _after_closure(self, model: "pl.LightningModule", optimizer: Any) -> None:
        # the fp32 norm of the gradients the step will use, before the callbacks (GradNormBackoff) read and clip them
        self.last_grad_norm = self.training_state.grad_norm(self.main_params(optimizer))
        super()._after_closure(model, optimizer)

    @override
    def optimizer_step(
        self, optimizer: Any, model: "pl.LightningModule", closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if not self._policy.owns_step:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure()
        # The step runs even when training_step returned None (no gradients: the optimizer moves nothing), as in
        # Lightning's own precision plugins: step hooks fire, so a callback that scaled the lr puts it back.
        return self._policy.step(optimizer, partial(self._after_closure, model, optimizer), kwargs)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        params = list(self.main_params(optimizer))
        self.last_grad_norm = self.training_state.grad_norm(params)  # pre-clip, after the callbacks
        self.training_state.clip(params, clip_val, self.last_grad_norm)

    # ------------------------------------------------------------------ checkpoint

    def rounding_state(self) -> dict[str, Any]:
        """This rank's stochastic-rounding generators (kahan; empty otherwise). Under node-sharded state each rank
        rounds only its own parameters' state, so the generators differ per rank: the strategy keeps them per rank
        (the precision state in the checkpoint holds rank 0's)."""
        return self._policy.rng_state()

    def load_rounding_state(self, state: dict[str, Any]) -> None:
        self._policy.load_rng_state(state)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._policy.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if not self._policy.names:  # before setup: applied in connect(), once the masters exist
            self._pending = state_dict
            return
        if state_dict.get("master") != self.master and rank_zero_only.rank == 0:
            log.info("HorizonPrecision: resuming master=%r from a checkpoint written with master=%r (converted)",
                     self.master, state_dict.get("master"))
        self._policy.load_state_dict(state_dict)


def choose_policy(
    mode: str, master: Optional[str], state: TrainingState, state_rounding: str, step_chunk_numel: int, seed: int
) -> Policy:
    """The one place the mode flags are read: the policy that implements ``mode`` (and ``master``)."""
    if mode == "bf16-mixed":
        return MixedPolicy(state)
    if master == "fp32":
        return FP32MasterPolicy(state)
    return KahanPolicy(state, state_rounding, step_chunk_numel, seed)


def _check_arguments(
    mode: Any, master: Any, compute: Any, backend: Any, state_rounding: Any, step_chunk_numel: Any, seed: Any
) -> None:
    """Raise a ValueError naming the parameter, the value and what is allowed, for the first bad argument."""
    owner = "HorizonPrecision"
    check_one_of(owner, "mode", mode, MODES)
    if mode == "bf16-true":
        check_one_of(owner, "master", master, (*MASTERS, None))
    elif master is not None:
        raise ValueError(
            f"HorizonPrecision(master={master!r}) with mode={mode!r}: only mode='bf16-true' has a master"
            f" (allowed there: {', '.join(map(repr, MASTERS))}); {mode!r} keeps the parameters themselves in"
            " fp32, so pass master=None"
        )
    check_one_of(owner, "compute", compute, COMPUTES)
    check_one_of(owner, "backend", backend, BACKENDS)
    check_one_of(owner, "state_rounding", state_rounding, STATE_ROUNDINGS)
    check_int(owner, "step_chunk_numel", step_chunk_numel, 1)
    require(is_int(seed), owner, "seed", seed, "an int")

