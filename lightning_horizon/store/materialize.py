"""Models larger than memory, never built whole: declared on the meta device, built layer by layer into the store.

:func:`deferred_init` is the context a model is declared in (``HorizonStrategy(state_store=...)`` enters it for
``trainer.init_module(empty_init=True)`` and around ``configure_model``; a user may enter it directly, e.g. around a
Hugging Face ``LlamaForCausalLM(config)``). In it every new tensor is made on the meta device (no memory), and every
operation on a meta tensor is recorded, in order, with its arguments: the parameters' creation, each module's own
init (``reset_parameters``, a model's ``_init``, Hugging Face's ``_init_weights``), buffers computed in ``__init__``
(a causal mask, rotary frequencies). The random generator's state at the start is recorded too.

:func:`materialize` replays that record at setup, from the recorded generator state, with each trainable
parameter's meta storage replaced by its view in the store's file: the same operations on the same shapes in the
same order from the same generator state compute the same values, bit for bit, as the in-RAM build (an in-RAM
build runs exactly these operations on CPU tensors). The replay streams: an operation that touches another layer
than the last one writes the last one back and lets it leave memory, so at most a layer (plus the resident unit:
embeddings, head) is in memory, whatever the number of passes the init makes over the model (the recipe's GPT
makes three: each Linear's own init at construction, the model's ``_init``, the residual projections' rescale).
Parameters tied after construction (a head tied to the embedding) leave their first storage orphaned: its init
still draws from the generator (the in-RAM build drew it), into a temporary tensor dropped after its last use.

The generator afterwards is where it would be after an in-RAM build, so that a fit is bitwise the RAM fit: after
``seed_everything`` Lightning reseeds at setup (its ``reset_seed``), before the replay, overwriting what an in-RAM
build drew: the generator is put back as it was before the replay. Without a seed, when nothing drew from it
between the declaration and setup, it is left where the replay ends (where the in-RAM build left it); when
something did, it is put back too (a draw in between cannot be reordered).

Hugging Face models skip their init when declared under ``torch.device("meta")`` (``init_weights`` sees the meta
device context); :func:`deferred_init` is not a device context for ``torch.tensor`` (values from data stay real),
so Hugging Face runs its init and the replay reproduces it. A model declared on the meta device outside
:func:`deferred_init` (plain ``torch.device("meta")``, accelerate's ``init_empty_weights``) has no record: it is
initialized by each module's ``reset_parameters`` in module order, then a Hugging Face model's
``initialize_weights`` (recorded at setup and replayed the same way); a buffer still on the meta device then fails,
naming it.

Pretrained weights (``StoreConfig(pretrained=...)``) are read one tensor at a time from safetensors files
(``safetensors.safe_open`` maps the file) into the store's views, after the init replay.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_horizon.state import swap_in  # noqa: E402

log = logging.getLogger(__name__)

META = torch.device("meta")
#: factories that take data (their values are the data's): not sent to the meta device
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.frombuffer}


def _key(t: Tensor) -> int:
    """The identity of ``t``'s storage (alive as long as the record holds a tensor on it)."""
    return t.untyped_storage()._cdata


class Recording:
    """The operations on meta tensors made while a model was declared, and the generator state around them."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, Any, Any, Any]] = []
        self.rng_start = torch.get_rng_state()
        self.rng_end: Optional[Tensor] = None
        self.storages: set[int] = set()  # every meta storage made in it


_RECORDINGS: list[Recording] = []


class _MetaFactories(TorchFunctionMode):
    """New tensors on the meta device, as ``torch.device("meta")`` makes them, but for factories that take data."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[dict] = None):
        kwargs = kwargs or {}
        if func in torch.utils._device._device_constructors() and func not in _FROM_DATA \
                and kwargs.get("device") is None:
            kwargs["device"] = META
        return func(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    def __init__(self, rec: Recording) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[dict] = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs, out))
        metas = [t for t in flat if isinstance(t, Tensor) and t.is_meta]
        if metas:
            self.rec.ops.append((func, args, kwargs, out))
            self.rec.storages.update(_key(t) for t in metas)
        return out


@contextmanager
def deferred_init() -> Iterator[Recording]:
    """Declare a model without building it: its tensors on the meta device, its init recorded for
    :func:`materialize` (what ``HorizonStrategy(state_store=...)`` does at setup)."""
    rec = Recording()
    _RECORDINGS.append(rec)
    with _MetaFactories(), _Recorder(rec):
        yield rec
    rec.rng_end = torch.get_rng_state()


def is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _recordings_of(tensors: list[Tensor]) -> list[Recording]:
    keys = {_key(t) for t in tensors if t.is_meta}
    return [r for r in _RECORDINGS if r.storages & keys]


def _record_own_init(module: nn.Module) -> Recording:
    """No record (declared outside :func:`deferred_init`): each module's ``reset_parameters`` in module order, then
    a Hugging Face model's ``initialize_weights``, recorded now."""
    rec = Recording()
    _RECORDINGS.append(rec)
    with _Recorder(rec):
        for m in module.modules():
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
        for m in module.modules():
            if callable(getattr(m, "initialize_weights", None)) and callable(getattr(m, "_init_weights", None)):
                m.initialize_weights()
    rec.rng_end = torch.get_rng_state()
    log.warning(f"state_store: {type(module).__name__} was declared on the meta device outside"
                " trainer.init_module(empty_init=True) / configure_model: initialized by each module's"
                " reset_parameters, then its initialize_weights where it has one (its own __init__'s init is not"
                " known: declare it under trainer.init_module(empty_init=True) to reproduce it bit for bit)")
    return rec


class _Replay:
    """The storages of a replay: meta storage -> (real untyped storage, byte offset)."""

    def __init__(self) -> None:
        self.real: dict[int, tuple[Any, int]] = {}

    def tensor(self, x: Tensor) -> Tensor:
        storage, offset = self.real[_key(x)]
        assert offset % x.element_size() == 0
        return torch.empty(0, dtype=x.dtype).set_(storage, offset // x.element_size() + x.storage_offset(),
                                                   x.size(), x.stride())

    def arg(self, x: Any) -> Any:
        if isinstance(x, Tensor) and x.is_meta:
            return self.tensor(x)
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x


@torch.no_grad()
def materialize(module: nn.Module, targets: dict[int, Tensor], unit_of: Callable[[int], Any],
                switch: Callable[[Any], None], params: bool = True) -> None:
    """Build ``module``'s meta tensors by replaying their record: ``targets`` maps the meta storage of each
    parameter the store holds to its view in the store (what the replay writes into); ``unit_of(storage key)`` names
    the store's unit of a storage (None: not the store's), and ``switch(unit)`` is called before an operation that
    touches another unit than the last one (the store releases the last one). Every other meta tensor (buffers,
    parameters the store does not hold) gets private memory. The module's meta tensors take their values in place:
    parameters are rebound by the caller (to ``targets``' views), buffers and other parameters here.
    ``params=False``: the buffers only (the parameters have their values: a checkpoint's), the generator untouched."""
    tensors = [*module.parameters(), *module.buffers()]
    recs = _recordings_of(tensors) or [_record_own_init(module)]
    rng_before = torch.get_rng_state()
    # Lightning reseeds every fit at setup (``reset_seed`` in ``setup_distributed``, from ``seed_everything``'s
    # PL_GLOBAL_SEED): an in-RAM build's draws are overwritten then, so the generator goes back to what it is now
    reseeded = os.environ.get("PL_GLOBAL_SEED") is not None
    undisturbed = not reseeded and recs[-1].rng_end is not None and torch.equal(rng_before, recs[-1].rng_end)
    replay = _Replay()
    skip: set[int] = set()  # params=False: the storages of every parameter in the record
    if not params:
        skip = {_key(t) for rec in recs for op in rec.ops for t in tree_flatten(op[1:3])[0]
                if isinstance(t, nn.Parameter) and t.is_meta}
    for key, view in targets.items():
        replay.real[key] = (view.untyped_storage(), view.storage_offset() * view.element_size())
    _replay_ops(recs, replay, skip, unit_of, switch)
    if not undisturbed or not params:  # something drew or reseeded since the declaration: its state stands
        torch.set_rng_state(rng_before)
    for rec in recs:
        _RECORDINGS.remove(rec)
    _fill_the_rest(module, targets, replay, params)


def _replay_ops(recs: list[Recording], replay: _Replay, skip: set[int], unit_of: Callable[[int], Any],
                switch: Callable[[Any], None]) -> None:
    """Run the recorded operations on real memory (``replay``'s storages), each record from its generator state;
    ``skip``'s storages and the store's parameters' creations left out, ``switch`` called as the units change."""
    unit = None
    for rec in recs:
        torch.set_rng_state(rec.rng_start)
        for func, args, kwargs, out in rec.ops:
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, Tensor) and o.is_meta]
            if func is torch.ops.aten.empty.memory_format and all(_key(o) in replay.real for o in outs):
                continue  # a parameter's creation: its storage is the store's view
            metas = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.is_meta]
            if skip and any(_key(t) in skip for t in (*metas, *outs)):
                continue
            touched = next((u for u in (unit_of(_key(t)) for t in metas) if u is not None), None)
            if touched is not None and touched is not unit:
                switch(touched)
                unit = touched
            result = func(*tree_map(replay.arg, args), **tree_map(replay.arg, kwargs))
            for o, r in zip(outs, [r for r in tree_flatten(result)[0] if isinstance(r, Tensor)]):
                replay.real.setdefault(_key(o), (r.untyped_storage(), 0))  # a new storage (a view: known)
    switch(None)


def _fill_the_rest(module: nn.Module, targets: dict[int, Tensor], replay: _Replay, params: bool) -> None:
    """What is not the store's (buffers; parameters it does not hold, with ``params``): private memory, the replay's
    values; raises for a meta tensor the replay never made."""
    missing = []
    for name, m in module.named_modules():
        for kind, table in (("buffer", m._buffers), ("parameter", m._parameters)):
            for n, t in table.items():
                if t is None or not t.is_meta or (kind == "parameter" and (_key(t) in targets or not params)):
                    continue
                if _key(t) not in replay.real:
                    missing.append(f"{name}.{n}" if name else n)
                    continue
                value = replay.tensor(t).clone()
                if kind == "buffer":
                    table[n] = value
                else:
                    swap_in(t, value)
    if missing:
        raise ValueError(f"state_store: {', '.join(missing)} of {type(module).__name__} stayed on the meta device:"
                         " nothing in its declaration made it; declare the model under"
                         " trainer.init_module(empty_init=True) or in configure_model")


@torch.no_grad()
def load_pretrained(module: nn.Module, paths: Sequence[str], prefix: Optional[str],
                    switch: Callable[[Tensor], None]) -> tuple[int, list[str], list[str]]:
    """Read each tensor of the safetensors files ``paths`` into ``module``'s parameter or buffer of that name (with
    ``prefix`` before it; ``None``: found from the first name that ends a parameter's name), one tensor at a time
    (``switch(param)`` first: the store releases the last unit). Returns (tensors read, the module's parameters
    not in the files, the files' names not in the module)."""
    from safetensors import safe_open

    named = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    seen: set[str] = set()
    unexpected: list[str] = []
    read = 0
    for path in paths:
        with safe_open(os.fspath(path), framework="pt") as f:
            for key in f.keys():
                if prefix is None:
                    prefix = next((n[: -len(key)] for n in named if n == key or n.endswith("." + key)), None)
                target = named.get((prefix or "") + key)
                if target is None:
                    unexpected.append(key)
                    continue
                value = f.get_tensor(key)
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"state_store: pretrained {key} in {path} has shape {tuple(value.shape)}, the"
                                     f" model's {(prefix or '') + key} {tuple(target.shape)}")
                switch(target)
                target.copy_(value)
                del value
                seen.add((prefix or "") + key)
                read += 1
    switch(None)
    params = dict(module.named_parameters())
    return read, [n for n in params if n not in seen], unexpected


__all__ = ["Recording", "deferred_init", "is_meta", "load_pretrained", "materialize"]
