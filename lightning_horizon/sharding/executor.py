"""Installs a ShardPlan: the planned module calls run under non-reentrant activation checkpointing.

Each planned module gets an instance attribute ``forward`` that wraps the original one. Nothing else on the
module changes, so parameter names, ``state_dict`` keys, parameters (tied ones included), hooks and ``isinstance``
all stay as they were; torch's checkpoint *wrapper* module, by contrast, changes the module's type and adds
``_checkpoint_wrapped_module.`` to every parameter name (its ``state_dict`` strips it again, torch 2.13).

- Non-reentrant ``torch.utils.checkpoint`` with ``preserve_rng_state=True``: a recompute replays the CPU RNG,
  so dropout masks are the same bits, and it restores the autocast state; its determinism check raises if a
  recompute produces tensors of other shapes than the forward did.
- A module called several times per step (a shared block, listed in ``counted``) is checkpointed only at the
  planned occurrences: the wrapper counts its calls made with grad enabled, and :meth:`Installed.reset`
  restarts the count at each step (calls past the profiled count run un-checkpointed: more memory, same
  result). A module called once per step is checkpointed at every call, with no count to keep. A recompute
  calls the original forward, so it neither counts nor nests.
- Under ``no_grad`` / ``inference_mode`` (validation) the original forward runs directly.
- Inside a compiled module (dynamo traces the wrapper) the checkpoint becomes part of the compiled graph: AOT
  autograd recomputes in the compiled backward from what the forward captured, so no context is re-established
  (dynamo takes only dispatch modes there).
- A recompute runs in backward, after training_step's contexts have exited: ``recompute_context(module)`` (the
  precision plugin's) re-establishes for it what the step's forward context established (bf16 weights swapped
  for fp32 copies, the default dtype), through checkpoint's ``context_fn``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_MISSING = object()
RecomputeContext = Callable[[nn.Module], AbstractContextManager]


class Installed:
    """The patched modules of one installed plan; :meth:`remove` puts every ``forward`` back as it was."""

    def __init__(
        self, root: nn.Module, recompute: Iterable[tuple[str, int]], counted: Iterable[str] = (),
        recompute_context: Optional[RecomputeContext] = None,
    ) -> None:
        self.counts: dict[str, int] = {}
        self._recompute_context = recompute_context
        self._patched: list[tuple[nn.Module, Any, Callable]] = []  # (module, previous instance attr, ours)
        wanted: dict[str, set[int]] = {}
        for name, occurrence in recompute:
            wanted.setdefault(name, set()).add(occurrence)
        try:
            for name, occurrences in wanted.items():
                module = root.get_submodule(name)
                previous = module.__dict__.get("forward", _MISSING)
                every = name not in set(counted)
                ours = self._wrap(name, module, None if every else frozenset(occurrences))
                module.forward = ours  # an instance attribute: not a parameter, buffer or submodule
                self._patched.append((module, previous, ours))
        except BaseException:
            self.remove()
            raise

    def _wrap(self, name: str, module: nn.Module, occurrences: Optional[frozenset[int]]) -> Callable:
        counts, original, context = self.counts, module.forward, self._recompute_context

        def contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
            return nullcontext(), (context(module) if context is not None else nullcontext())

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return original(*args, **kwargs)
            if occurrences is not None:
                n = counts.get(name, 0)
                counts[name] = n + 1
                if n not in occurrences:
                    return original(*args, **kwargs)
            # where dynamo traces this call (a compiled module) its checkpoint takes dispatch modes as context_fn,
            # not contexts, and the recompute runs in the compiled backward on what the forward captured
            own = {} if torch.compiler.is_compiling() else {"context_fn": contexts}
            return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True, **own, **kwargs)

        forward.__wrapped__ = original  # type: ignore[attr-defined]
        forward.__name__ = "forward"
        return forward

    @property
    def modules(self) -> list[nn.Module]:
        return [m for m, _, _ in self._patched]

    def reset(self) -> None:
        """Start counting calls afresh: called at every step boundary."""
        self.counts.clear()

    def remove(self) -> None:
        for module, previous, ours in reversed(self._patched):
            if module.__dict__.get("forward") is not ours:
                raise RuntimeError(
                    f"{type(module).__name__}.forward was replaced after sharding installed its plan; refusing"
                    " to overwrite it (uninstall sharding before patching forward yourself)"
                )
            if previous is _MISSING:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = previous
        self._patched.clear()
        self.counts.clear()


def install(
    root: nn.Module, recompute: Iterable[tuple[str, int]], counted: Iterable[str] = (),
    recompute_context: Optional[RecomputeContext] = None,
) -> Installed:
    """Checkpoint the given (module path, occurrence) calls of ``root``; ``counted`` names the modules called
    more than once per step; ``recompute_context(module)``, when given, is entered around each recompute of
    ``module``. Returns the handle that uninstalls."""
    return Installed(root, recompute, counted, recompute_context)


__all__ = ["Installed", "install"]
