"""The parts contract: what HorizonStrategy calls on each of its parts, and the registry that keeps them.

A part is one capability's per-rank runtime object: the RNG state, the gradient sync, the graph sharder. The
strategy never probes a part with ``hasattr``: every part implements :class:`Part` (subclass it for the no-op
defaults), and :class:`Parts` calls each hook on every part, in the order they were added (a part that reads what
another changes says so in ``runs_before`` and stays ahead of it), and owns the saving and restoring of their
per-rank state (the strategy gathers it to rank 0 under one checkpoint key). What a capability splits of
Lightning's own checkpoint entries (a node's weights, the owners' shares of the optimizer state) is its
:class:`CheckpointStep`'s, which lives as long as the strategy: a checkpoint is read before setup makes the parts.

Lifecycle, as HorizonStrategy drives it:

- ``connect(trainer, module, optimizers)``: in ``Strategy.setup`` once the optimizers and the precision plugin are
  connected (a part made before them, in ``_setup_model``, finishes its setup here: what it refuses, what it holds).
  First the registry checks what every part declares (:meth:`Parts.check`): two parts that ``takes`` the same thing
  (the parameters' storage, the gradient path) are refused, naming both, and so is an optimizer a part ``refuses``.
- ``after_setup()``: the end of ``Strategy.setup``, once every part exists and has its saved state.
- ``before_training_step(module, batch, batch_idx, step_context)`` / ``after_training_step(output)``: around every
  ``training_step`` (``step_context``: the precision plugin's ``train_step_context``, for work that must see the
  step's dtypes); ``output`` is what Lightning and the callbacks will see.
- ``pre_backward(sync)`` / ``post_backward()``: around every backward; ``sync`` is False on accumulation
  micro-batches (inside ``block_backward_sync``: DDP's ``no_sync``).
- ``clip_gradients(plugin, optimizer, clip_val, algorithm)``: every clip of the fit, whichever path asked for it
  (``Trainer(gradient_clip_val=...)``, ``self.clip_gradients`` from ``configure_gradient_clipping`` or in manual
  optimization: all end in the precision plugin's ``clip_gradients``, which the registry routes here from
  ``connect`` to ``teardown``, :meth:`Parts.route_clipping`); True: the part clipped, the plugin's own clip does not
  run; False (default): it does.
- ``gradients_ready()``: inside every optimizer step, after its closure (forward, backward) and before the
  optimizer reads the gradients (with LBFGS after each of its closure calls).
- ``optimizer_stepped(optimizer)``: after every optimizer step (``optimizer``: the one that stepped), before
  anything reads the weights again.
- ``after_optimizer_step()``: after the optimizer step of every batch that steps (accounting, local SGD's
  periodic average, re-plans); in manual optimization once per batch, after ``training_step`` and so after
  all of its optimizer steps.
- ``before_save(model)``: on every rank before a checkpoint is written (collective work such as settling DDP's
  bucket layout happens here, on all ranks alike).
- ``comm_metrics()``: the last step's communication figures: what the part itself sent, as ``comm/intra_bytes``,
  ``comm/inter_bytes`` (or a name of its own), ``comm/seconds``, ``comm/calls`` (``strategy.comm_metrics()`` sums
  the parts' figures of the same name).
- ``state_dict()`` / ``load_state_dict(state)``: the part's per-rank state; a part whose ``layout_free`` is True
  gathers a state of every rank's on rank 0 (its ``state_dict`` is collective), which is saved once and handed to
  every rank of any world size.
- ``teardown()``: the end of the fit; the module leaves as it came in.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, runtime_checkable

from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from torch import nn

from lightning_horizon.optim import torch_optimizer

#: what a part may take for itself (:attr:`Part.takes`); two parts that take the same one cannot run together
PARAMETERS = "the parameters' storage"
GRADIENTS = "the gradient path"


@runtime_checkable
class PartProtocol(Protocol):
    label: str
    takes: Mapping[str, str]
    layout_free: bool
    runs_before: tuple[str, ...]

    def refuses(self, optimizer: Any) -> Optional[str]: ...

    def connect(self, trainer: Any, module: nn.Module, optimizers: list[Any]) -> None: ...

    def after_setup(self) -> None: ...

    def before_training_step(self, module: nn.Module, batch: Any, batch_idx: int, step_context: Any) -> None: ...

    def after_training_step(self, output: Any) -> None: ...

    def pre_backward(self, sync: bool) -> None: ...

    def post_backward(self) -> None: ...

    def clip_gradients(self, plugin: Any, optimizer: Any, clip_val: float, algorithm: Any) -> bool: ...

    def gradients_ready(self) -> None: ...

    def optimizer_stepped(self, optimizer: Any) -> None: ...

    def after_optimizer_step(self) -> None: ...

    def before_save(self, model: nn.Module) -> None: ...

    def comm_metrics(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def teardown(self) -> None: ...


class Part:
    """Base class of a strategy part: every hook a no-op, no state, takes nothing, refuses no optimizer. Override
    what the part needs."""

    #: how a refusal names the part: the option that makes it, as the user wrote it (default: its registry name)
    label: str = ""
    #: what the part takes for itself (:data:`PARAMETERS`, :data:`GRADIENTS`) and how: a second part taking the
    #: same is refused at setup, naming both
    takes: Mapping[str, str] = MappingProxyType({})
    #: the part's ``state_dict`` is collective and whole on rank 0 (e.g. a table's rows gathered from every rank):
    #: saved once, loaded by every rank whatever the world size
    layout_free: bool = False
    #: the parts (by registry name) whose hooks must run after this part's, because this part reads what theirs
    #: change: the registry keeps it ahead of them whenever either is added (:meth:`Parts.add`)
    runs_before: tuple[str, ...] = ()

    def refuses(self, optimizer: Any) -> Optional[str]:
        """Why this part cannot step ``optimizer`` (torch's, unwrapped), or ``None``: checked at setup."""
        return None

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

    def clip_gradients(self, plugin: Any, optimizer: Any, clip_val: float, algorithm: Any) -> bool:
        return False

    def gradients_ready(self) -> None:
        pass

    def optimizer_stepped(self, optimizer: Any) -> None:
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


class CheckpointStep:
    """What one capability adds to the strategy's checkpoints beyond its parts' per-rank ``state_dict``: state that
    Lightning's own entries (the weights, ``optimizer_states``, the precision state) hold for rank 0 only, which the
    capability splits across ranks, nodes or files. A step lives as long as the strategy (a checkpoint is read
    before setup makes the parts); fit_parts.py lists the steps, strategy_checkpoint.py calls each in that order.
    ``strategy``: the strategy's public side. Every hook a no-op here: override what the capability needs."""

    #: the keys this step adds to a rank's gathered entry: its own, never handed to a part
    rank_keys: tuple[str, ...] = ()

    def save(self, strategy: Any, checkpoint: dict[str, Any], filepath: Any, rank_entry: dict[str, Any]) -> dict:
        """On every rank before rank 0 writes ``checkpoint`` (collective work runs alike on all): change
        ``checkpoint`` (rank 0's is the one written), add to ``rank_entry`` (this rank's, gathered to rank 0); the
        dict returned is kept once in the strategy's entry, for every rank and layout."""
        return {}

    def load(self, strategy: Any, checkpoint: dict[str, Any], saved: dict[str, Any], path: Any,
             same_layout: bool) -> dict[str, Any]:
        """The loaded ``checkpoint`` as this rank restores it when fitting (``saved``: the strategy's entry;
        ``same_layout``: saved by as many ranks)."""
        return checkpoint

    def optimizer_states(self, strategy: Any, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint whose ``optimizer_states`` this rank's optimizers load."""
        return checkpoint

    def after_setup(self, strategy: Any) -> None:
        """At the end of the strategy's setup, once the module is built and wrapped."""

    def removed(self, strategy: Any, filepath: Any) -> None:
        """After the checkpoint at ``filepath`` was removed (what it had beside it goes too)."""


def part(name: str, doc: str) -> property:
    """A read-only attribute of the strategy: its part ``name`` while it has one, else ``None``."""
    return property(lambda strategy: strategy.parts.get(name), doc=doc)


class Parts:
    """The strategy's parts by name, and their saved state waiting for the part that will take it."""

    def __init__(self) -> None:
        self._parts: dict[str, PartProtocol] = {}
        self._saved: dict[str, Any] = {}  # this rank's saved states not yet handed to a part
        self._unroute: Optional[Callable[[], None]] = None  # undoes route_clipping (connect to teardown)
        self._removed: dict[str, Any] = {}  # the last part of each name that was removed

    def add(self, name: str, part: PartProtocol) -> PartProtocol:
        """Register ``part`` (replacing one of the same name) after the others, but ahead of the parts it
        :attr:`~Part.runs_before`; it gets its saved state now if one is waiting."""
        if not isinstance(part, PartProtocol):
            missing = [m for m in _HOOKS if not hasattr(part, m)]
            raise TypeError(
                f"part {name!r}={type(part).__name__}: a strategy part implements {', '.join(_HOOKS)};"
                f" missing {', '.join(missing)} (subclass lightning_horizon.parts.Part for no-op defaults)"
            )
        order = [(n, p) for n, p in self._parts.items() if n != name]
        ahead = [i for i, (n, _) in enumerate(order) if n in part.runs_before]  # the parts it must run before
        if ahead:
            self._parts = dict(order[:ahead[0]] + [(name, part)] + order[ahead[0]:])
        else:
            self._parts[name] = part  # a part replaced keeps its place
        if name in self._saved:
            part.load_state_dict(self._saved.pop(name))
        return part

    def remove(self, *names: str) -> None:
        """Forget the parts ``names`` (those there are): they have torn down and must not take part in what follows
        (:meth:`last` still gives each)."""
        for name in names:
            if name in self._parts:
                self._removed[name] = self._parts.pop(name)

    def last(self, name: str) -> Optional[Any]:
        """The part ``name`` while there is one, else the last one removed (``None`` if none ever was)."""
        return self._parts.get(name, self._removed.get(name))

    def get(self, name: str) -> Optional[Any]:
        return self._parts.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._parts

    def __iter__(self) -> Iterator[PartProtocol]:
        return iter(list(self._parts.values()))

    # ------------------------------------------------------------------ hooks

    def check(self, optimizers: list[Any]) -> None:
        """Refuse what the parts declare they cannot run with: two parts taking one thing, or an optimizer one of them
        cannot step (ValueError naming both)."""
        taken: dict[str, tuple[str, str]] = {}  # thing -> (label, how) of the first part that takes it
        for name, part in self._parts.items():
            _refuse_taken(taken, part.label or name, part)
            for opt in map(torch_optimizer, optimizers):
                why = part.refuses(opt)
                if why is not None:
                    raise ValueError(f"{part.label or name} cannot step {type(opt).__name__}: {why}")

    def refuse_taken(self, name: str, part: PartProtocol) -> None:
        """Refuse ``part`` (not added yet) when it takes what a registered part takes (ValueError naming both):
        called before a part installs itself, so that nothing moves first."""
        taken: dict[str, tuple[str, str]] = {}
        for other_name, other in self._parts.items():
            _refuse_taken(taken, other.label or other_name, other)
        _refuse_taken(taken, part.label or name, part)

    def connect(self, trainer: Any, module: nn.Module, optimizers: list[Any]) -> None:
        """Check what the parts declare, route every clip through them until teardown, connect each."""
        self.check(optimizers)
        if self._unroute is None:
            self._unroute = self.route_clipping(trainer.precision_plugin)
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

    def clip_gradients(self, plugin: Any, optimizer: Any, clip_val: float, algorithm: Any) -> bool:
        """True when a part clipped (the first that does; the others are not asked)."""
        return any(part.clip_gradients(plugin, optimizer, clip_val, algorithm) for part in self)

    def route_clipping(self, plugin: Any) -> Callable[[], None]:
        """Route ``plugin.clip_gradients`` (the end of every clipping path) through :meth:`clip_gradients` until the
        returned function is called; where no part clips, the plugin's own runs, as it would have."""
        own, before = plugin.clip_gradients, plugin.__dict__.get("clip_gradients")

        def routed(optimizer: Any, clip_val: float = 0.0,
                   gradient_clip_algorithm: Any = GradClipAlgorithmType.NORM) -> None:
            if clip_val > 0 and self.clip_gradients(plugin, optimizer, clip_val, gradient_clip_algorithm):
                return
            own(optimizer, clip_val, gradient_clip_algorithm)

        plugin.clip_gradients = routed  # this instance only: what it had (the class's method) again once undone

        def undo() -> None:
            if plugin.__dict__.get("clip_gradients") is routed:
                if before is None:
                    del plugin.clip_gradients
                else:
                    plugin.clip_gradients = before
        return undo

    def gradients_ready(self) -> None:
        for part in self:
            part.gradients_ready()

    def optimizer_stepped(self, optimizer: Any) -> None:
        for part in self:
            part.optimizer_stepped(optimizer)

    def after_optimizer_step(self) -> None:
        for part in self:
            part.after_optimizer_step()

    def before_save(self, model: nn.Module) -> None:
        for part in self:
            part.before_save(model)

    def teardown(self) -> None:
        for part in self:
            part.teardown()
        if self._unroute is not None:
            self._unroute()  # the plugin's own clip_gradients again
            self._unroute = None

    def comm_metrics(self) -> dict[str, float]:
        """Every part's figures; a figure two parts report (bytes, seconds, calls of their own traffic) summed."""
        out: dict[str, float] = {}
        for part in self:
            for k, v in part.comm_metrics().items():
                out[k] = out.get(k, 0.0) + v
        return out

    # ------------------------------------------------------------------ state

    def state_dicts(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self._parts.items()}

    def layout_free(self) -> list[str]:
        """The names of the parts whose state is whole on rank 0 (:attr:`Part.layout_free`)."""
        return [name for name, part in self._parts.items() if part.layout_free]

    def load_state_dicts(self, states: dict[str, Any]) -> None:
        """Hand each saved state to its part: now if it exists, else when it is added."""
        self._saved = dict(states)
        for name, part in self._parts.items():
            if name in self._saved:
                part.load_state_dict(self._saved.pop(name))


def _refuse_taken(taken: dict[str, tuple[str, str]], label: str, part: PartProtocol) -> None:
    """Add what ``part`` takes to ``taken`` (thing -> (label, how) of the first part that takes it); ValueError
    naming both where one is taken already."""
    for thing, how in part.takes.items():
        if thing in taken:
            other, other_how = taken[thing]
            raise ValueError(f"{other} with {label}: both take {thing} ({other}: {other_how}; {label}: {how});"
                             " use one of them")
        taken[thing] = (label, how)


_HOOKS = ("label", "takes", "layout_free", "runs_before", "refuses", "connect", "after_setup", "before_training_step",
          "after_training_step", "pre_backward", "post_backward", "clip_gradients", "gradients_ready",
          "optimizer_stepped", "after_optimizer_step", "before_save", "comm_metrics", "state_dict", "load_state_dict",
          "teardown")

__all__ = ["CheckpointStep", "GRADIENTS", "PARAMETERS", "part", "Part", "PartProtocol", "Parts"]
