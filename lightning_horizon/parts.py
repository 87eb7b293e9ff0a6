"""The parts contract: what HorizonStrategy calls on each of its parts, and the registry that keeps them.

A part is one capability's per-rank runtime object: the RNG state, the gradient sync, the graph sharder. The
strategy never probes a part with ``hasattr``: every part implements :class:`Part` (subclass it for the no-op
defaults), and :class:`Parts` calls each hook on every part, in the order they were added, and owns the saving
and restoring of their per-rank state (the strategy gathers it to rank 0 under one checkpoint key).

Lifecycle, as HorizonStrategy drives it:

- ``connect(trainer, module, optimizers)``: in ``Strategy.setup`` once the optimizers and the precision plugin are
  connected (a part made before them, in ``_setup_model``, finishes its setup here: what it refuses, what it holds).
- ``after_setup()``: the end of ``Strategy.setup``, once every part exists and has its saved state.
- ``before_training_step(module, batch, batch_idx, step_context)`` / ``after_training_step(output)``: around every
  ``training_step`` (``step_context``: the precision plugin's ``train_step_context``, for work that must see the
  step's dtypes); ``output`` is what Lightning and the callbacks will see.
- ``pre_backward(sync)`` / ``post_backward()``: around every backward; ``sync`` is False on accumulation
  micro-batches (inside ``block_backward_sync``: DDP's ``no_sync``).
- ``gradients_ready()``: inside every optimizer step, after its closure (forward, backward) and before the
  optimizer reads the gradients (with LBFGS after each of its closure calls).
- ``optimizer_stepped()``: after every optimizer step, before anything reads the weights again.
- ``after_optimizer_step()``: after the optimizer step of every batch that steps (accounting, local SGD's
  periodic average, re-plans); in manual optimization once per batch, after ``training_step`` and so after
  all of its optimizer steps.
- ``before_save(model)``: on every rank before a checkpoint is written (collective work such as settling DDP's
  bucket layout happens here, on all ranks alike).
- ``comm_metrics()``: the last step's communication figures (``strategy.comm_metrics()`` merges every part's).
- ``state_dict()`` / ``load_state_dict(state)``: the part's per-rank state.
- ``teardown()``: the end of the fit; the module leaves as it came in.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class PartProtocol(Protocol):
    def connect(self, trainer: Any, module: nn.Module, optimizers: list[Any]) -> None: ...

    def after_setup(self) -> None: ...

    def before_training_step(self, module: nn.Module, batch: Any, batch_idx: int, step_context: Any) -> None: ...

    def after_training_step(self, output: Any) -> None: ...

    def pre_backward(self, sync: bool) -> None: ...

    def post_backward(self) -> None: ...

    def gradients_ready(self) -> None: ...

    def optimizer_stepped(self) -> None: ...

    def after_optimizer_step(self) -> None: ...

    def before_save(self, model: nn.Module) -> None: ...

    def comm_metrics(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def teardown(self) -> None: ...


class Part:
    """Base class of a strategy part: every hook a no-op, no state. Override what the part needs."""

    def connect(self, trainer: Any, module: nn.Module, optimizers: list[Any]) -> None:
        pass

    def after_setup(self) -> None:
        pass

    def before_training_step(self, module: nn.Module, batch: Any, batch_idx: int, step_context: Any) -> None:
        pass

    def after_training_step(self, output: Any) -> None:
        pass

    def pre_backward(self, sync: bool) -> None:
        pass

    def post_backward(self) -> None:
        pass

    def gradients_ready(self) -> None:
        pass

    def optimizer_stepped(self) -> None:
        pass

    def after_optimizer_step(self) -> None:
        pass

    def before_save(self, model: nn.Module) -> None:
        pass

    def comm_metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def teardown(self) -> None:
        pass


def part(name: str, doc: str) -> property:
    """A read-only attribute of the strategy: its part ``name`` while it has one, else ``None``."""
    return property(lambda strategy: strategy.parts.get(name), doc=doc)


class Parts:
    """The strategy's parts by name, and their saved state waiting for the part that will take it."""

    def __init__(self) -> None:
        self._parts: dict[str, PartProtocol] = {}
        self._saved: dict[str, Any] = {}  # this rank's saved states not yet handed to a part

    def add(self, name: str, part: PartProtocol) -> PartProtocol:
        """Register ``part`` (replacing one of the same name); it gets its saved state now if one is waiting."""
        if not isinstance(part, PartProtocol):
            missing = [m for m in _HOOKS if not callable(getattr(part, m, None))]
            raise TypeError(
                f"part {name!r}={type(part).__name__}: a strategy part implements {', '.join(_HOOKS)};"
                f" missing {', '.join(missing)} (subclass lightning_horizon.parts.Part for no-op defaults)"
            )
        self._parts[name] = part
        if name in self._saved:
            part.load_state_dict(self._saved.pop(name))
        return part

    def remove(self, name: str) -> None:
        """Forget the part ``name`` (if any): it has torn down and must not take part in what follows."""
        self._parts.pop(name, None)

    def get(self, name: str) -> Optional[Any]:
        return self._parts.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._parts

    def __iter__(self) -> Iterator[PartProtocol]:
        return iter(list(self._parts.values()))

    # ------------------------------------------------------------------ hooks

    def connect(self, trainer: Any, module: nn.Module, optimizers: list[Any]) -> None:
        for part in self:
            part.connect(trainer, module, optimizers)

    def after_setup(self) -> None:
        for part in self:
            part.after_setup()
        self._saved = {}  # a state whose part this run does not create is not kept for a later fit

    def before_training_step(self, module: nn.Module, batch: Any, batch_idx: int, step_context: Any) -> None:
        for part in self:
            part.before_training_step(module, batch, batch_idx, step_context)

    def after_training_step(self, output: Any) -> None:
        for part in self:
            part.after_training_step(output)

    def pre_backward(self, sync: bool) -> None:
        for part in self:
            part.pre_backward(sync)

    def post_backward(self) -> None:
        for part in self:
            part.post_backward()

    def gradients_ready(self) -> None:
        for part in self:
            part.gradients_ready()

    def optimizer_stepped(self) -> None:
        for part in self:
            part.optimizer_stepped()

    def after_optimizer_step(self) -> None:
        for part in self:
            part.after_optimizer_step()

    def before_save(self, model: nn.Module) -> None:
        for part in self:
            part.before_save(model)

    def teardown(self) -> None:
        for part in self:
            part.teardown()

    def comm_metrics(self) -> dict[str, float]:
        return {k: v for part in self for k, v in part.comm_metrics().items()}

    # ------------------------------------------------------------------ state

    def state_dicts(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self._parts.items()}

    def load_state_dicts(self, states: dict[str, Any]) -> None:
        """Hand each saved state to its part: now if it exists, else when it is added."""
        self._saved = dict(states)
        for name, part in self._parts.items():
            if name in self._saved:
                part.load_state_dict(self._saved.pop(name))


_HOOKS = ("connect", "after_setup", "before_training_step", "after_training_step", "pre_backward", "post_backward",
          "gradients_ready", "optimizer_stepped",
          "after_optimizer_step", "before_save", "comm_metrics", "state_dict", "load_state_dict", "teardown")

__all__ = ["part", "Part", "PartProtocol", "Parts"]
