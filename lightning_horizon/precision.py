"""HorizonPrecision: bf16 where the hardware makes it fast, fp32 where precision needs it, on any CPU.

Modes (``plugins=[HorizonPrecision(...)]``):

- ``"bf16-mixed"`` (``"auto"`` is an alias): parameters, gradients, micro-batch gradient accumulation and
  optimizer state in fp32; matmul-class ops under ``torch.autocast(bf16)`` when the compute dtype is bf16.
- ``"bf16-true"``: module weights stored in bf16, updated through a master the optimizer steps on:
  ``master="fp32"`` (an fp32 copy that the optimizer owns; its fp32 gradients are in the optimizer's param
  groups before ``on_before_optimizer_step``) or ``master="kahan"`` (a bf16 compensation buffer holding the low
  bits the bf16 weight cannot; the optimizer state is kept in bf16 between steps and upcast around the step).

``compute="auto"`` picks bf16 compute only where bf16 matmuls run in hardware (AVX512-BF16 or AMX on x86, BF16 on
Arm, a bf16 GPU). Elsewhere a bf16 matmul is emulated and 10-100x slower than fp32, so the weights are upcast and
everything computes in fp32 (bf16-true then still halves weight memory). Bytes per parameter: docs/precision.md.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Generator, Optional

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_horizon import cpu
from lightning_horizon.gradnorm import clip_grads_, total_norm_fp32
from lightning_horizon.state import TrainingState

log = logging.getLogger(__name__)

MODES = ("auto", "bf16-mixed", "bf16-true")
MASTERS = ("kahan", "fp32")  # bf16-true only; None picks "kahan"
COMPUTES = ("auto", "bf16", "fp32")
BACKENDS = ("native", "ipex", "auto")
STATE_ROUNDINGS = ("stochastic", "nearest")
_STATE_VERSION = 1
_NOISE = 1 << 16  # elements in a stochastic-rounding noise window


# ---------------------------------------------------------------------------------------------- ISA detection


def resolve_compute(compute: str, device_type: str = "cpu") -> tuple[str, str]:
    """The compute dtype ("bf16" or "fp32") for ``compute`` on ``device_type``, and the reason, for the log."""
    if device_type == "cuda":
        found, ok = "CUDA", torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    elif device_type == "cpu":
        found_isa = cpu.isa()
        found, ok = found_isa.description, found_isa.native_bf16
    else:
        found, ok = device_type, False
    have = "native bf16" if ok else "no native bf16"
    if compute != "auto":
        slow = "" if ok or compute == "fp32" else " (expect bf16 matmuls to be many times slower than fp32)"
        return compute, f"ISA found: {found}; {have}; compute={compute!r} forced{slow}"
    if ok:
        return "bf16", f"ISA found: {found}; {have} -> bf16 compute; pass compute='fp32' to force fp32"
    return "fp32", f"ISA found: {found}; {have} -> fp32 compute; pass compute='bf16' to force"


def ipex_status() -> tuple[Any, str]:
    """``(ipex, "")`` when intel_extension_for_pytorch imports and matches torch's major.minor, else ``(None, why)``."""
    try:
        import intel_extension_for_pytorch as ipex  # type: ignore[import-not-found]
    except ImportError:
        return None, "intel_extension_for_pytorch is not installed (its last release, 2.8, needs torch 2.8.*)"
    except Exception as err:  # a mismatched build can fail while loading its C++ extension
        return None, f"intel_extension_for_pytorch failed to import: {type(err).__name__}: {err}"
    want = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    have = ".".join(str(getattr(ipex, "__version__", "?")).split("+")[0].split(".")[:2])
    if have != want:
        return None, f"intel_extension_for_pytorch {ipex.__version__} does not match torch {torch.__version__}"
    return ipex, ""


# ---------------------------------------------------------------------------------------------- the plugin


class HorizonPrecision(Precision):
    """bf16 mixed / true precision with fp32 or Kahan masters, an ISA-aware compute dtype and an fp32 grad norm.

    Args:
        mode: ``"bf16-mixed"`` (fp32 weights, grads, state; bf16 autocast), ``"bf16-true"`` (bf16 weights with a
            master), or ``"auto"`` (= ``"bf16-mixed"``: the right choice on any hardware).
        master: bf16-true only: ``"kahan"`` (default; bf16 weights + bf16 compensation, bf16 optimizer state
            between steps) or ``"fp32"`` (an fp32 master copy the optimizer updates, copied back each step).
        compute: ``"auto"`` (bf16 only where it runs in hardware), ``"bf16"`` or ``"fp32"`` (force).
        backend: ``"native"`` (torch), ``"ipex"`` or ``"auto"`` (``ipex.optimize`` when it imports and matches
            torch; otherwise native, with a message). Applies to bf16-mixed; bf16-true manages its own weights.
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
        _check("mode", mode, MODES)
        if mode == "bf16-true":
            _check("master", master, (*MASTERS, None))
        elif master is not None:
            raise ValueError(
                f"HorizonPrecision(master={master!r}) with mode={mode!r}: only mode='bf16-true' has a master"
                f" (allowed there: {', '.join(map(repr, MASTERS))}); {mode!r} keeps the parameters themselves in"
                " fp32, so pass master=None"
            )
        _check("compute", compute, COMPUTES)
        _check("backend", backend, BACKENDS)
        _check("state_rounding", state_rounding, STATE_ROUNDINGS)
        if isinstance(step_chunk_numel, bool) or not isinstance(step_chunk_numel, int) or step_chunk_numel < 1:
            raise ValueError(f"HorizonPrecision(step_chunk_numel={step_chunk_numel!r}): allowed is an int >= 1")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"HorizonPrecision(seed={seed!r}): allowed is an int")
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
        self._device_type = "cpu"
        self._set_compute(*resolve_compute(compute, "cpu"))
        self._module: Optional[Module] = None
        self._names: dict[Tensor, str] = {}  # module parameter -> its state_dict name
        #: the owner of the true weights: the fp32 masters or Kahan compensations are registered there, and
        #: whoever reads, writes or averages weights (local SGD, checkpoints) goes through it
        self.training_state = TrainingState()
        self._param_of: dict[Tensor, Tensor] = {}  # fp32 master -> bf16 module parameter (during a step only)
        self._load_hooked: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
        self._slots: list[tuple[Module, str]] = []  # where the fp32-compute forward swaps in upcast weights
        self._upcasting = False
        self._generators: dict[str, torch.Generator] = {}
        self._noise: Optional[Tensor] = None
        self._pending: Optional[dict[str, Any]] = None  # state loaded before connect()

    def _set_compute(self, compute: str, reason: str) -> None:
        self.compute, self.reason = compute, reason
        # what `trainer.precision` and the model summary report: the arithmetic that really runs
        self.precision = "bf16-true" if self.mode == "bf16-true" else ("bf16-mixed" if compute == "bf16" else "32-true")

    @property
    def policy(self) -> str:
        """The dtype policy in one line (logged once at setup on rank zero)."""
        if self.mode == "bf16-mixed":
            store = "weights, grads and optimizer state fp32"
        elif self.master == "fp32":
            store = "weights bf16 + fp32 master, grads fp32 (master), optimizer state fp32"
        else:
            store = f"weights bf16 + bf16 Kahan compensation, grads bf16, optimizer state bf16 ({self.state_rounding})"
        return f"HorizonPrecision(mode={self.mode!r}): {store}; {self.reason}"

    # ------------------------------------------------------------------ setup

    @override
    def convert_module(self, module: Module) -> Module:
        self._module = module
        if self.mode == "bf16-true":
            for p in module.parameters():
                if p.is_floating_point() and p.dtype != torch.bfloat16:
                    p.data = p.data.to(torch.bfloat16)  # .data keeps the Parameter objects (and any ties) intact
        return module

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        module = self._module if self._module is not None else model
        self._module = module
        first = next(iter(module.parameters()), None)
        self._device_type = first.device.type if first is not None else "cpu"
        self._set_compute(*resolve_compute(self.requested_compute, self._device_type))
        if rank_zero_only.rank == 0:
            log.info(self.policy)
        self._names = {p: n for n, p in module.named_parameters()}
        if self.mode == "bf16-true":
            if self.compute == "bf16":  # bf16 activations meet bf16 buffers (HalfPrecision does the same)
                for b in module.buffers():
                    if b.is_floating_point():
                        b.data = b.data.to(torch.bfloat16)
            else:
                self._slots = [(m, n) for m in module.modules() for n, p in m._parameters.items() if p is not None]
            for opt in optimizers:
                self._wrap_optimizer(opt)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.load_state_dict(pending)
        if self.backend != "native":
            optimizers = self._ipex(module, optimizers)
        return model, optimizers, lr_schedulers

    def _wrap_optimizer(self, opt: Optimizer) -> None:
        if isinstance(opt, LBFGS):
            raise ValueError(
                "HorizonPrecision(mode='bf16-true') cannot wrap LBFGS (it re-evaluates the closure inside step);"
                " use mode='bf16-mixed' or another optimizer"
            )
        own = _own_parameter_list(opt, set(map(id, self._names)))
        if own is not None:
            raise ValueError(
                f"HorizonPrecision(mode='bf16-true') cannot drive the optimizer {type(opt).__name__}: it keeps its"
                f" own list of the parameters ({type(opt).__name__}.{own}) instead of reading param_groups at each"
                " step, so the fp32 / Kahan master it must step would never move; use mode='bf16-mixed' with it"
            )
        state = self.training_state
        for group in opt.param_groups:
            for p in group["params"]:
                if p not in self._names:
                    raise ValueError(
                        f"HorizonPrecision(mode='bf16-true'): the optimizer {type(opt).__name__} holds a tensor of"
                        f" shape {tuple(p.shape)} that is not a parameter of the LightningModule"
                    )
                if p.dtype != torch.bfloat16:
                    continue  # integer / frozen-in-other-dtype parameters: stepped as they are
                if self.master == "fp32":
                    m = state.master(p)
                    if m is None or not torch.equal(m.detach().to(torch.bfloat16), p.detach()):
                        m = torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)  # weights changed
                        state.register_master(p, m)
                    if p in opt.state:  # state between steps is kept under the module parameter, in fp32
                        opt.state[p] = _cast_state(opt.state[p], p, torch.float32)
                elif state.compensation(p) is None:  # a kept one holds at most half an ulp: harmless
                    state.register_compensation(p, torch.zeros_like(p, dtype=torch.bfloat16))
        if self.master == "fp32" and opt not in self._load_hooked:
            # torch casts loaded optimizer state to its parameter's dtype: load it while the fp32 masters stand in
            opt.register_load_state_dict_pre_hook(lambda o, sd: self._swap_masters(o, True))
            opt.register_load_state_dict_post_hook(lambda o: self._swap_masters(o, False))
            self._load_hooked.add(opt)

    def _ipex(self, module: Module, optimizers: list[Optimizer]) -> list[Optimizer]:
        ipex, why = ipex_status()
        if ipex is None or self.mode != "bf16-mixed" or len(optimizers) != 1:
            if ipex is not None:  # without an optimizer ipex.optimize would apply inference-only rewrites
                why = "ipex.optimize is applied when training with mode='bf16-mixed' and one optimizer"
            level = logging.WARNING if self.backend == "ipex" else logging.INFO
            if rank_zero_only.rank == 0:
                log.log(level, "HorizonPrecision(backend=%r): using native torch: %s", self.backend, why)
            return optimizers
        # fp32 weights (autocast does the bf16 part); prepacking replaces parameters, which a DDP wrapper
        # built before this point would not see, so only a single process prepacks
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        _, optimizer = ipex.optimize(module, optimizer=optimizers[0], inplace=True, weights_prepack=not distributed)
        if rank_zero_only.rank == 0:
            log.info("HorizonPrecision: ipex %s optimize(weights_prepack=%s)", ipex.__version__, not distributed)
        return [optimizer]

    # ------------------------------------------------------------------ forward

    @override
    def forward_context(self) -> Any:
        if self.mode == "bf16-true" and self.compute == "fp32":
            return self._upcast_weights()
        if self.compute == "bf16":
            return self._bf16_context()
        return nullcontext()

    @contextmanager
    def _bf16_context(self) -> Generator[None, None, None]:
        # autocast also on bf16 weights: CPU autocast runs the losses (cross_entropy, nll, mse) in fp32. bf16-true
        # makes bf16 the default dtype inside the step, as Lightning's own "bf16-true" does.
        default = _default_dtype(torch.bfloat16) if self.mode == "bf16-true" else nullcontext()
        with default, torch.autocast(self._device_type, dtype=torch.bfloat16, cache_enabled=False):
            yield

    def recompute_context(self, module: Module) -> Any:
        """What :meth:`forward_context` established, re-established for the recompute of one call of ``module``
        (activation recompute runs in backward, after the step's forward context has exited): the bf16 default
        dtype, and under fp32 compute the fp32 copies of ``module``'s own parameters only (autocast itself is
        restored by ``torch.utils.checkpoint``)."""
        if self.mode != "bf16-true":
            return nullcontext()
        if self.compute == "fp32":
            mine = {id(m) for m in module.modules()}
            return self._upcast_weights([(m, n) for m, n in self._slots if id(m) in mine])
        return _default_dtype(torch.bfloat16)

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

    @override
    def convert_input(self, data: Any) -> Any:
        if self.mode == "bf16-true" and self.compute == "bf16":
            return _map_float_tensors(data, lambda t: t.to(torch.bfloat16))
        return data

    # ------------------------------------------------------------------ optimizer step

    @override
    def _after_closure(self, model: "pl.LightningModule", optimizer: Any) -> None:
        # the fp32 norm of the gradients the step will use, before the callbacks (GradNormBackoff) read and clip them
        self.last_grad_norm = total_norm_fp32(list(self.main_params(optimizer)))
        super()._after_closure(model, optimizer)

    def _swap_masters(self, optimizer: Optimizer, to_masters: bool, grads: bool = False) -> None:
        """Put the fp32 masters in the optimizer's param groups in place of their bf16 parameters, or back.

        Between steps the optimizer holds the module's parameters, so that everything a LightningModule does with
        it (``zero_grad``, ``toggle_optimizer``, ``clip_gradients`` in manual optimization) acts on the tensors
        backward writes to. During the step (and while a state dict loads) the masters stand in. With ``grads``
        the gradients move along: in fp32 for the step, back in the parameter's dtype after it (clipped, or None
        for a skipped step: what the step used, as with fp32 parameters). The optimizer state moves along too,
        keyed by whoever is in the group.
        """
        state = self.training_state
        for group in optimizer.param_groups:
            for i, x in enumerate(group["params"]):
                new = state.master(x) if to_masters else self._param_of.pop(x, None)
                if new is None:
                    continue
                if to_masters:
                    self._param_of[new] = x
                if grads:
                    new.grad = None if x.grad is None else x.grad.detach().to(new.dtype)
                    x.grad = None
                group["params"][i] = new
                if x in optimizer.state:
                    optimizer.state[new] = optimizer.state.pop(x)

    @override
    def optimizer_step(
        self, optimizer: Any, model: "pl.LightningModule", closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.mode != "bf16-true":
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure()
        # The step runs even when training_step returned None (no gradients: the optimizer moves nothing), as in
        # Lightning's own precision plugins: step hooks fire, so a callback that scaled the lr puts it back.
        if self.master != "fp32":
            self._after_closure(model, optimizer)
            return self._kahan_step(optimizer, kwargs)
        self._swap_masters(optimizer, True, grads=True)
        try:
            self._after_closure(model, optimizer)
            out = optimizer.step(**kwargs)
            with torch.no_grad():
                for m, p in self._param_of.items():
                    if m.grad is not None:  # a param without grad was not stepped
                        self.training_state.write(p, m)
            return out
        finally:
            self._swap_masters(optimizer, False, grads=True)

    def _kahan_step(self, optimizer: Optimizer, kwargs: dict[str, Any]) -> Any:
        """Step fp32 proxies of the bf16 parameters, chunk by chunk, and fold the results back.

        The optimizer's param groups briefly hold fp32 proxies (weight + compensation, fp32 grad, fp32 state)
        instead of the bf16 parameters; the parameters themselves never change dtype, which would reset their
        grad accumulators and with them DDP's gradient hooks.
        """
        groups = optimizer.param_groups
        todo = [(i, p) for i, g in enumerate(groups) for p in g["params"] if p.grad is not None]
        self._noise = None  # a fresh stochastic-rounding block for this step
        if not todo:  # nothing to update (e.g. a skipped step): still one call, so step hooks run as usual
            return optimizer.step(**kwargs)
        chunks: list[list[tuple[int, Tensor]]] = [[]]
        size = 0
        for i, p in todo:
            if chunks[-1] and size + p.numel() > self.step_chunk_numel:
                chunks.append([])
                size = 0
            chunks[-1].append((i, p))
            size += p.numel()
        saved = [g["params"] for g in groups]
        pre, post = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
        out = None
        try:
            for c, chunk in enumerate(chunks):
                # step hooks once per training step: pre-hooks with the first chunk, post-hooks with the last
                optimizer._optimizer_step_pre_hooks = pre if c == 0 else OrderedDict()
                optimizer._optimizer_step_post_hooks = post if c == len(chunks) - 1 else OrderedDict()
                for g in groups:
                    g["params"] = []
                proxies = [(p, self._proxy(optimizer, p)) for _, p in chunk if self.training_state.compensation(p) is not None]
                stepped = dict(proxies)
                for i, p in chunk:  # a parameter without compensation (not bf16) steps as it is
                    groups[i]["params"].append(stepped.get(p, p))
                try:
                    out = optimizer.step(**kwargs)
                finally:
                    for p, w in proxies:
                        self._fold(optimizer, p, w)
        finally:
            optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = pre, post
            for g, params in zip(groups, saved):
                g["params"] = params
        return out

    @torch.no_grad()
    def _proxy(self, optimizer: Optimizer, p: Tensor) -> Tensor:
        """The fp32 true weight (bf16 weight + compensation) with an fp32 grad, owning p's state in fp32."""
        w = self.training_state.read(p)
        w.grad = p.grad.detach().float()
        state = optimizer.state.pop(p, None)
        if state:
            optimizer.state[w] = _cast_state(state, p, torch.float32)
        return w

    @torch.no_grad()
    def _fold(self, optimizer: Optimizer, p: Tensor, w: Tensor) -> None:
        """Round the stepped fp32 weight into bf16 weight + bf16 compensation (the residual); state back to bf16."""
        self.training_state.write(p, w)  # bf16 weight rounded to nearest, the residual into the compensation
        state = optimizer.state.pop(w, None)
        if not state:
            return
        optimizer.state[p] = state
        for k, x in list(state.items()):
            if _per_element(k, x, p) and x.dtype != torch.bfloat16:
                state[k] = x.to(torch.bfloat16) if self.state_rounding == "nearest" else self._round_stochastic(x)

    def _round_stochastic(self, x: Tensor) -> Tensor:
        """bf16 by stochastic rounding: add a uniform fraction of one bf16 ulp to the 16 bits bf16 drops, then
        truncate (unbiased). The noise is a window, at a random offset, of a block drawn once per step, added
        with a broadcast: a fresh draw per element costs more than the whole optimizer step."""
        gen = self._generator(x.device)
        if self._noise is None or self._noise.device != x.device:
            self._noise = torch.empty(2 * _NOISE, dtype=torch.int32, device=x.device).random_(0, 1 << 16, generator=gen)
        off = int(torch.randint(0, _NOISE, (1,), generator=gen, device=gen.device))
        block = self._noise[off : off + _NOISE]
        bits = x.contiguous().view(torch.int32).view(-1)
        full = bits.numel() - bits.numel() % _NOISE
        if full:
            bits[:full].view(-1, _NOISE).add_(block)
        bits[full:].add_(block[: bits.numel() - full])
        return bits.bitwise_and_(-65536).view(torch.float32).view(x.shape).to(torch.bfloat16)  # exact

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device)
            self._generators[key].manual_seed(self.seed)
        return self._generators[key]

    # ------------------------------------------------------------------ clipping

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        params = list(self.main_params(optimizer))
        self.last_grad_norm = total_norm_fp32(params)  # pre-clip, after the callbacks
        clip_grads_(params, clip_val, self.last_grad_norm)

    # ------------------------------------------------------------------ checkpoint

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.mode != "bf16-true":
            return {}  # the fp32 parameters are the whole truth (an empty dict is not written)
        state = self.training_state
        return {
            "version": _STATE_VERSION,
            "mode": self.mode,
            "master": self.master,
            "masters": {n: m.detach() for p, n in self._names.items() if (m := state.master(p)) is not None},
            "compensation": {n: c for p, n in self._names.items() if (c := state.compensation(p)) is not None},
            "rng": {k: g.get_state() for k, g in self._generators.items()},
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if not self._names:  # before setup: applied in connect(), once the masters exist
            self._pending = state_dict
            return
        masters, comps = state_dict.get("masters", {}), state_dict.get("compensation", {})
        if state_dict.get("master") != self.master and rank_zero_only.rank == 0:
            log.info("HorizonPrecision: resuming master=%r from a checkpoint written with master=%r (converted)",
                     self.master, state_dict.get("master"))
        with torch.no_grad():
            for p, name in self._names.items():
                exact = masters[name].float() if name in masters else None
                if exact is None and name in comps:
                    exact = p.float() + comps[name].float()
                if exact is None:
                    continue
                master, comp = self.training_state.master(p), self.training_state.compensation(p)
                if self.mode == "bf16-mixed":
                    p.copy_(exact)  # fp32 parameters take the full-precision weights
                elif master is not None:
                    master.copy_(exact)
                elif comp is not None:  # the saved compensation as it is: p may not be restored yet
                    comp.copy_(comps[name] if name in comps else exact - p.float())
        for key, rng in state_dict.get("rng", {}).items():
            self._generator(torch.device(key)).set_state(rng)


# ---------------------------------------------------------------------------------------------- helpers


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _check(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(
            f"HorizonPrecision({name}={value!r}): allowed are {', '.join(repr(a) for a in allowed)}"
        )


def _per_element(key: Any, value: Any, p: Tensor) -> bool:
    """Optimizer state that has one entry per parameter element (moments, buffers); not ``step`` or scalars."""
    return (key != "step" and isinstance(value, Tensor) and value.is_floating_point() and value.dim() > 0
            and value.shape == p.shape)


def _cast_state(state: dict[str, Any], p: Tensor, dtype: torch.dtype) -> dict[str, Any]:
    return {k: v.to(dtype) if _per_element(k, v, p) else v for k, v in state.items()}


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
