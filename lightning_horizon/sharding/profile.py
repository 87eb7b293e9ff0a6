"""One profiling pass over ``training_step``: what each module call saves for backward, and what it costs.

The pass runs the user's ``training_step`` once, forward only (no backward, no optimizer step), with

- forward pre/post hooks on every submodule: the call order, the call tree, the bytes entering and leaving
  each call (what a cut before it would have to keep);
- saved-tensor hooks: every tensor autograd keeps for backward, deduplicated by storage and attributed to the
  innermost call that saved it first (parameters excluded: they are resident anyway);
- ``torch.utils.flop_counter.FlopCounterMode``: forward FLOPs per call (the price of recomputing it);
- a dispatch mode that marks calls which must not be recomputed: data-dependent ops (``item``, ``nonzero``...),
  in-place writes to state (BatchNorm's running stats, a tensor attribute: a recompute would apply them twice),
  in-place writes to a call's own inputs (a recompute would read the modified values) and random ops drawing
  from a module's own ``torch.Generator`` (checkpointing replays only the global one: a recompute would draw
  other numbers).

It runs under FakeTensor where it can: no memory, no compute, the full batch. Where the step is data-dependent
or an op has no fake kernel, it runs for real on a slice of the batch and scales the figures back up. Either
way, ``self.log`` and (manual optimization) backward and optimizer calls are silenced, the torch RNG state is
restored, every pre-existing tensor written in place (buffers, parameters, the batch) is put back, and so is the
modules' Python state (isolation.py): the profile leaves no trace, and no fake tensor stays behind.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.flop_counter import FlopCounterMode

from lightning_horizon.checks import check_one_of
from lightning_horizon.rehearsal import rehearsing
from lightning_horizon.console import info_once
from lightning_horizon.sharding.isolation import UserState, silenced, tensors_in

log = logging.getLogger(__name__)

_aten = torch.ops.aten
# Ops whose result (value or shape) is read back into Python or depends on the data's values.
_DATA_DEPENDENT = {
    _aten._local_scalar_dense, _aten.nonzero, _aten.masked_select, _aten.unique_consecutive,
    _aten._unique, _aten._unique2, _aten.unique_dim, _aten.bincount, _aten.repeat_interleave,
}


@dataclass
class Call:
    """One call of one module during the profiled step. Byte and FLOP figures are for the full batch."""

    index: int
    name: str  #: module path under the profiled root ("" for the root itself)
    occurrence: int  #: n-th call of this module in the step (a shared module is called several times)
    parent: int  #: index of the enclosing call, -1 when called from training_step itself
    in_bytes: int = 0  #: non-parameter tensors passed in: what a checkpoint of this call keeps
    out_bytes: int = 0
    saved_bytes: int = 0  #: saved for backward inside this call (its children included), first saves only
    max_saved: int = 0  #: the largest single saved storage inside
    flops: int = 0  #: forward FLOPs (matmul-class ops, as torch's flop counter counts them)
    param_bytes: int = 0
    grad_bytes: int = 0  #: gradients of its parameters that do not exist yet (allocated by backward)
    reason: str = ""  #: why this call must not be recomputed; empty when it may
    children: list[int] = field(default_factory=list)
    #: in forward order: ("call", child index) or ("saved", bytes saved directly in this call's own code)
    timeline: list[tuple[str, int]] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.occurrence)


@dataclass
class Profile:
    calls: list[Call]
    top: list[tuple[str, int]]  #: the timeline of training_step itself (its calls and its own saves)
    mode: str  #: "fake" or "real"
    batch_scale: float  #: full batch / profiled batch (1 in fake mode)
    total_saved: int
    param_bytes: int
    pending_grad_bytes: int  #: gradients backward will allocate (parameters whose .grad is None now)
    forward_flops: int
    note: str = ""  #: why a fake pass fell back to a real one

    def by_key(self) -> dict[tuple[str, int], Call]:
        return {c.key: c for c in self.calls}


def _storage(t: torch.Tensor) -> tuple[Optional[int], int]:
    """(identity of the storage behind ``t``, its size in bytes); views share their base's identity."""
    try:
        s = t.untyped_storage()
        return s._cdata, s.nbytes()
    except Exception:  # sparse, nested or other storage-less tensors: not planned for
        return None, 0


class _Profiler(TorchDispatchMode):
    """Hooks, saved-tensor hooks and a dispatch mode, sharing one call stack."""

    def __init__(
        self, root: nn.Module, fake_mode: Optional[FakeTensorMode], flops: FlopCounterMode,
        attributes: Iterable[torch.Tensor] = (),
    ) -> None:
        super().__init__()
        self.fake, self.flop_mode = fake_mode is not None, flops
        self.names = {id(m): n for n, m in root.named_modules()}
        # Parameters and buffers by storage. Under FakeTensor an op converts a real parameter to a fake one
        # (memoized per tensor): convert them all up front so that their fake storages are known too, and a
        # saved view of a weight (Linear saves weight.t()) is not counted as an activation.
        self.state: dict[int, torch.Tensor] = {}
        self.buffer_keys: set[int] = set()
        self.fakes: list[torch.Tensor] = []
        # Tensor attributes (a metric's state, a cached mask) are state like buffers: resident, and a call that
        # writes one in place must not be recomputed.
        state = [*((p, False) for p in root.parameters()), *((a, False) for a in attributes)]
        for t, is_buffer in [*state, *((b, True) for b in root.buffers())]:
            versions = [t]
            if fake_mode is not None:
                self.fakes.append(fake_mode.from_tensor(t))
                versions.append(self.fakes[-1])
            for v in versions:
                key, _ = _storage(v)
                if key is not None:
                    self.state[key] = t
                    if is_buffer:
                        self.buffer_keys.add(key)
        self.calls: list[Call] = []
        self.top: list[tuple[str, int]] = []
        self.stack: list[int] = []
        self.flops_at: dict[int, int] = {}
        self.occurrences: dict[str, int] = {}
        self.inputs_of: dict[int, list[int]] = {}  # storage -> calls that received it as an input
        self.saved_seen: set[int] = set()
        self.keep: list[torch.Tensor] = []  # keeps saved storages alive so that their identities stay unique
        self.snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.total_saved = 0

    # -------------------------------------------------------------- module hooks

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        name = self.names[id(module)]
        occ = self.occurrences.get(name, 0)
        self.occurrences[name] = occ + 1
        call = Call(index=len(self.calls), name=name, occurrence=occ, parent=self.stack[-1] if self.stack else -1)
        seen: set[int] = set()
        for t in tensors_in((args, kwargs)):
            key, n = _storage(t)
            if key is None or key in self.state or key in seen:
                continue
            seen.add(key)
            call.in_bytes += n
            self.inputs_of.setdefault(key, []).append(call.index)
        (self.calls[call.parent].timeline if call.parent >= 0 else self.top).append(("call", call.index))
        if call.parent >= 0:
            self.calls[call.parent].children.append(call.index)
        self.calls.append(call)
        self.flops_at[call.index] = self.flop_mode.get_total_flops()
        self.stack.append(call.index)

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        name = self.names[id(module)]
        while self.stack:  # always_call hooks also fire on an exception: unwind to this module's call
            call = self.calls[self.stack.pop()]
            if call.name == name:
                break
        seen: set[int] = set()
        for t in tensors_in(output):
            key, n = _storage(t)
            if key is not None and key not in self.state and key not in seen:
                seen.add(key)
                call.out_bytes += n
        call.flops = self.flop_mode.get_total_flops() - self.flops_at.pop(call.index)

    # -------------------------------------------------------------- saved tensors

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        # Detached: a saved output packed as itself is a cycle (tensor -> grad_fn -> saved tensor) that lives in
        # autograd's C++ nodes, out of the collector's sight; the profiling pass never runs backward, so the saved
        # values only have to keep their storages.
        key, n = _storage(t)
        t = t.detach()
        if key is None or key in self.state or key in self.saved_seen:
            return t
        self.saved_seen.add(key)
        self.keep.append(t)
        self.total_saved += n
        (self.calls[self.stack[-1]].timeline if self.stack else self.top).append(("saved", n))
        for i in self.stack:
            self.calls[i].saved_bytes += n
            self.calls[i].max_saved = max(self.calls[i].max_saved, n)
        return t

    # -------------------------------------------------------------- dispatch: what a recompute must not repeat

    def _mark_stack(self, reason: str) -> None:
        for i in self.stack:
            self.calls[i].reason = self.calls[i].reason or reason

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.fake and not self.stack and func is _aten._local_scalar_dense.default:
            # training_step reads a value back outside any module (``loss.item()`` for a print or a list): a
            # fake tensor has none. 1 keeps the arithmetic on it (a division, a range) working; inside a module
            # the value may steer the graph, so there the fake pass fails and a real one runs instead.
            dtype = args[0].dtype
            return True if dtype == torch.bool else 1.0 if dtype.is_floating_point or dtype.is_complex else 1
        if func.overloadpacket in _DATA_DEPENDENT:
            self._mark_stack(f"data-dependent ({func.overloadpacket.__name__})")
        generator = kwargs.get("generator", next((a for a in args if isinstance(a, torch.Generator)), None))
        # torch.utils.checkpoint replays the default generator only. At dispatch each op gets a fresh Python
        # wrapper of its generator, so compare the C++ objects.
        if generator is not None and generator._cdata != torch.default_generator._cdata:
            self._mark_stack("draws from its own torch.Generator (a recompute would draw different numbers)")
        schema = func._schema
        if "batch_norm" in func.overloadpacket.__name__:
            # native_batch_norm updates the running stats in place without declaring it in its schema
            for t in tensors_in(list(args)):
                if _storage(t)[0] in self.buffer_keys:
                    self._on_write(t)
        if schema.is_mutable:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                for t in tensors_in(args[i] if i < len(args) else kwargs.get(arg.name)):
                    self._on_write(t)
        return func(*args, **kwargs)

    def _on_write(self, t: torch.Tensor) -> None:
        key, _ = _storage(t)
        if key is None:
            return
        real = not isinstance(t, FakeTensor)
        if key in self.state or (self.fake and real):
            # A fake pass still executes in-place ops on real tensors: keep a copy to put back afterwards.
            if real and key not in self.snapshots:
                with _disable_current_modes():  # a real copy, not a fake one
                    self.snapshots[key] = (t, t.detach().clone())
            self._mark_stack("writes state in place (a recompute would write it twice)")
        for i in self.inputs_of.get(key, ()):
            c = self.calls[i]
            c.reason = c.reason or "its input is modified in place (a recompute would read the new values)"

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.snapshots.values():
                t.copy_(saved)


# torch's own bookkeeping in a module's __dict__ (parameters, buffers, submodules, hooks): not the user's state, and
# the profile's hooks come and go there by their handles.
def _takes_batch_idx(fn: Any) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _run(module: nn.Module, batch: Any, batch_idx: int) -> Any:
    step = getattr(module, "training_step", None)
    if step is None:  # a plain nn.Module: its forward is the step
        return module(batch)
    return step(batch, batch_idx) if _takes_batch_idx(step) else step(batch)


def _profile_once(module: nn.Module, batch: Any, batch_idx: int, fake: bool) -> tuple[_Profiler, int]:
    flop_mode = FlopCounterMode(display=False)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    user = UserState(module)  # before the profiler's own hooks, and before fake mode: real clones
    prof = _Profiler(module, fake_mode, flop_mode, user.attributes)
    handles = []
    # The root too: training_step is the top of the tree, and a call of the root's own forward is one call in it.
    for m in module.modules():
        handles.append(m.register_forward_pre_hook(prof.pre, with_kwargs=True))
        handles.append(m.register_forward_hook(prof.post, with_kwargs=True, always_call=True))
    rng = torch.get_rng_state()
    try:
        # force_eager: a torch.compile'd module runs eagerly here. Dynamo refuses a frame under a dispatch mode
        # (ours, the flop counter, FakeTensor) and marks its code "skip" for good: without this, the user's
        # compiled model would run eagerly for the whole fit, silently.
        with rehearsing(), torch.enable_grad(), silenced(module), torch.compiler.set_stance("force_eager"):
            if fake_mode is not None:
                fake_mode.__enter__()
            try:
                # Modes nest innermost-last: ours sees each op first (real state tensors still real), then the
                # flop counter, then FakeTensor.
                with flop_mode, prof, saved_tensors_hooks(prof.pack, lambda t: t):
                    _run(module, batch, batch_idx)
            finally:
                if fake_mode is not None:
                    fake_mode.__exit__(None, None, None)
        return prof, flop_mode.get_total_flops()
    finally:
        for h in handles:
            h.remove()
        prof.restore()
        user.restore()
        torch.set_rng_state(rng)
        # The pass's graph is never backwarded and its saved tensors are in ``keep``: a cycle through autograd's
        # nodes that Python's collector cannot see, which kept one step's activations (and views of the weights)
        # alive for the rest of the fit.
        prof.keep.clear()
        prof.snapshots.clear()


def _slice_batch(batch: Any, fraction: float) -> tuple[Any, float]:
    """The first ``fraction`` of the samples (leading dim shared by the batch's tensors), copied, and the scale."""
    sizes = {t.shape[0] for t in tensors_in(batch) if t.dim() > 0}
    if len(sizes) != 1:
        return batch, 1.0  # no common leading dimension: run the whole batch
    full = sizes.pop()
    keep = max(1, int(full * fraction))

    def cut(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj[:keep].clone() if obj.dim() > 0 else obj.clone()
        if isinstance(obj, (list, tuple)):
            out = [cut(o) for o in obj]
            return type(obj)(*out) if hasattr(obj, "_fields") else type(obj)(out)
        if isinstance(obj, dict):
            return type(obj)({k: cut(v) for k, v in obj.items()})
        return obj

    return cut(batch), full / keep


def profile_step(
    module: nn.Module, batch: Any, batch_idx: int = 0, mode: str = "auto", batch_fraction: float = 0.25
) -> Profile:
    """Profile one ``training_step`` (or ``forward`` for a plain module) of ``module`` on ``batch``."""
    check_one_of("profile_step", "mode", mode, ("auto", "fake", "real"))
    note, scale = "", 1.0
    prof = None
    if mode in ("auto", "fake"):
        try:
            prof, flops = _profile_once(module, batch, batch_idx, fake=True)
        except Exception as e:  # data-dependent step, op without a fake kernel, anything fake mode refuses
            if mode == "fake":
                raise RuntimeError(f"profile='fake': the fake pass failed ({type(e).__name__}: {e});"
                                   " use profile='auto' or 'real'") from e
            note = f"fake pass failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
            if not (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
                # expected for a step that depends on its data's values (or an op fake tensors lack): not an error
                info_once(log, f"sharding: profiling a real slice of the batch (expected: this step reads values"
                               f" that fake tensors lack, {type(e).__name__})")
            log.debug(f"sharding profile: {note}")
    if prof is None:
        sub, scale = _slice_batch(batch, batch_fraction)
        prof, flops = _profile_once(module, sub, batch_idx, fake=False)
    calls = prof.calls
    for c in calls:
        c.in_bytes, c.out_bytes = int(c.in_bytes * scale), int(c.out_bytes * scale)
        c.saved_bytes, c.max_saved, c.flops = int(c.saved_bytes * scale), int(c.max_saved * scale), int(c.flops * scale)
        c.timeline = [(k, int(v * scale)) if k == "saved" else (k, v) for k, v in c.timeline]
    top = [(k, int(v * scale)) if k == "saved" else (k, v) for k, v in prof.top]
    modules = dict(module.named_modules())
    sizes: dict[str, tuple[int, int]] = {}
    for c in calls:
        if c.name not in sizes:
            sizes[c.name] = _param_sizes(modules[c.name])
        c.param_bytes, c.grad_bytes = sizes[c.name]
    params, pending = _param_sizes(module)
    return Profile(
        calls=calls, top=top, mode="fake" if prof.fake else "real", batch_scale=scale,
        total_saved=int(prof.total_saved * scale), param_bytes=params, pending_grad_bytes=pending,
        forward_flops=int(flops * scale), note=note,
    )


def _param_sizes(module: nn.Module) -> tuple[int, int]:
    """(bytes of the parameters, bytes of their gradients not yet allocated), tied parameters counted once."""
    seen: set[int] = set()
    total = pending = 0
    for p in module.parameters():
        key, n = _storage(p)
        if key is None or key in seen:
            continue
        seen.add(key)
        total += n
        if p.requires_grad and p.grad is None:
            pending += n
    return total, pending


__all__ = ["Call", "Profile", "profile_step"]
