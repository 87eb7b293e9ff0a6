"""What keeps the sharding profile's extra run of ``training_step`` from leaving a trace.

The profile runs the user's ``training_step`` once more, on the first batch, before the real step. Nothing of that
run may show afterwards: :class:`UserState` takes the modules' Python state before it and puts it back after,
:func:`silenced` turns logging, backward and optimizer calls into no-ops during it, and :func:`ensure_real` is
the guard that a fake or meta tensor never reaches Lightning or a user's callback.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj`` (nested lists, tuples and dict values)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)


_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}
_MISSING = object()


class UserState:
    """The Python state of every module, taken before a profiling pass and put back after it.

    training_step runs once more for the profile; whatever it does to the modules must not show afterwards (a
    counter, a list it appends to, a torchmetrics metric it updates, a mask it caches, possibly a fake one):

    - each module's ``__dict__`` entries (torch's internals aside) and its buffer slots: attributes and buffers
      added during the pass are removed, rebound ones put back (buffers' values are the profiler's to restore);
    - builtin containers reachable from them (list, dict, set, tuple; recursively): their contents are copied and
      written back into the same objects, so appends are undone;
    - tensors reachable from them that are not parameters or buffers: cloned and copied back into the same
      tensor objects, so in-place updates (a metric's state) are undone; ``torch.Generator`` states too.

    Other objects are kept by reference and never copied: a module holds its trainer, loggers, datamodule...
    """

    def __init__(self, root: nn.Module) -> None:
        resident = {id(t) for t in (*root.parameters(), *root.buffers())}
        self.dicts = [(m, {k: v for k, v in m.__dict__.items() if k not in _MODULE_INTERNALS}) for m in root.modules()]
        # a buffer rebound or registered in the step (a cached mask) is a slot in _buffers, not in __dict__
        self.containers: list[tuple[Any, list]] = [
            (c, list(c.items()) if isinstance(c, dict) else list(c))
            for m in root.modules() for c in (m._buffers, m._non_persistent_buffers_set)
        ]
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []
        seen: set[int] = set(resident)
        todo = [v for _, d in self.dicts for v in d.values()]
        while todo:
            obj = todo.pop()
            if id(obj) in seen:
                continue
            if isinstance(obj, torch.Tensor):
                seen.add(id(obj))
                if isinstance(obj, nn.Parameter) or obj.is_meta:
                    continue
                with torch.no_grad():
                    self.tensors.append((obj, obj.detach().clone()))
            elif isinstance(obj, torch.Generator):
                seen.add(id(obj))
                self.generators.append((obj, obj.get_state()))
            elif isinstance(obj, (list, tuple, set, frozenset, dict)):
                seen.add(id(obj))
                items = list(obj.items()) if isinstance(obj, dict) else list(obj)
                if not isinstance(obj, (tuple, frozenset)):
                    self.containers.append((obj, items))
                todo.extend(obj.values() if isinstance(obj, dict) else items)

    @property
    def attributes(self) -> list[torch.Tensor]:
        return [t for t, _ in self.tensors]

    def restore(self) -> None:
        for module, saved in self.dicts:
            d = module.__dict__
            for k in [k for k in d if k not in _MODULE_INTERNALS and k not in saved]:
                del d[k]
            for k, v in saved.items():
                if d.get(k, _MISSING) is not v:
                    d[k] = v
        for obj, items in self.containers:
            if isinstance(obj, list):
                obj[:] = items
            else:
                obj.clear()
                obj.update(items)
        with torch.no_grad():
            for t, saved in self.tensors:
                if t.shape != saved.shape or t.dtype != saved.dtype:
                    # resized or retyped in place: take the saved one whole (an attribute: no parameter is saved)
                    t.data = saved
                elif not torch.equal(t, saved):
                    t.copy_(saved)
        for g, state in self.generators:
            g.set_state(state)


def ensure_real(obj: Any, where: str) -> None:
    """Raise when ``obj`` holds a fake or meta tensor: one must never reach Lightning or a user's callback."""
    for t in tensors_in(obj):
        if isinstance(t, FakeTensor) or t.is_meta:
            kind = "FakeTensor" if isinstance(t, FakeTensor) else "meta tensor"
            raise RuntimeError(
                f"{where} returned a {kind} (shape {tuple(t.shape)}): the sharding profile's fake pass left it in"
                " state it did not restore (a global, an object outside the modules). Pass"
                " ShardingConfig(profile='real') to profile on real tensors, or keep that state on the module"
            )


class _Silent:
    """Stands in for optimizers and schedulers during the pass: every method is a no-op and a context."""

    def __getattr__(self, name: str) -> Any:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> "_Silent":
        return self

    def __enter__(self) -> "_Silent":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


@contextmanager
def silenced(module: nn.Module) -> Iterator[None]:
    """Patch the instance so that logging, backward and optimizer calls made in training_step do nothing."""
    names = ["log", "log_dict"]
    if getattr(module, "automatic_optimization", True) is False:
        names += ["manual_backward", "toggle_optimizer", "untoggle_optimizer", "clip_gradients"]
    saved = {n: module.__dict__[n] for n in names + ["optimizers", "lr_schedulers"] if n in module.__dict__}
    silent = _Silent()
    for n in names:
        if hasattr(module, n):
            object.__setattr__(module, n, silent)
    if getattr(module, "automatic_optimization", True) is False:
        trainer = getattr(module, "_trainer", None)
        n_opt = len(trainer.optimizers) if trainer is not None else 1
        object.__setattr__(module, "optimizers", lambda *a, **k: silent if n_opt <= 1 else [silent] * n_opt)
        object.__setattr__(module, "lr_schedulers", lambda *a, **k: silent)
    try:
        yield
    finally:
        for n in names + ["optimizers", "lr_schedulers"]:
            module.__dict__.pop(n, None)
        module.__dict__.update(saved)


__all__ = ["UserState", "ensure_real", "silenced", "tensors_in"]
