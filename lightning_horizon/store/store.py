"""StateStore: every per-parameter tensor of training in memory-mapped files, one file per (layer, kind).

The kinds: ``weight`` (the module parameter itself: ``TrainingState.rebind`` makes its data a view, so Parameter
objects, hooks, optimizers and state_dict keys are untouched), ``grad``, ``master`` / ``master_grad`` (bf16-true with
fp32 masters), ``compensation`` (Kahan), and ``state.<key>.<dtype>`` (each per-element optimizer state tensor). A
layer's file of one kind is created at that kind's first tensor, sized for all the layer's parameters, and carved in
order.

Values never change on the way in: a tensor placed in the store is copied into its view bit for bit, so a run
with a store computes exactly what the same run in RAM computes. What the store changes is where the bytes are
between uses; :class:`StateStore` moves a layer's pages in (prefetch, on its reading threads) before it is used and out
(unmap, write back, drop from the page cache) after (store/pages.py):

- forward: a unit's weights are prefetched when the previous unit starts, and unmapped when it has run (the last
  unit stays: its backward comes next);
- backward: a unit's gradients go into the store as they are accumulated (over last step's, discarded unread);
  when the unit is complete (every parameter of it that this backward reaches has its gradient) it steps
  (:attr:`unit_ready`, set by the step in backward for the step's last micro-batch), its weights and gradients
  leave memory and the unit before it is prefetched (with its state, when it will step);
- the gradient norm, clipping and the fp32 masters' copy-back walk the gradients layer by layer (:meth:`stream`);
- the optimizer step runs layer by layer (store/step.py), in or after backward, reading and writing each layer's
  state once.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from lightning_horizon.precision.policy import per_element
from lightning_horizon.state import TrainingState
from lightning_horizon.store.materialize import is_meta, load_pretrained, materialize
from lightning_horizon.store.files import MappedFile, Reservation
from lightning_horizon.store.pages import UnitPages
from lightning_horizon.store.sizes import GRAD, WEIGHT, file_bytes, pending, state_kind
from lightning_horizon.store.units import Unit

log = logging.getLogger(__name__)


class StateStore(UnitPages):
    """The store of one rank: files under ``folder``, the units, the reading and the writing thread (their page
    movement: :class:`~lightning_horizon.store.pages.UnitPages`)."""

    def __init__(self, folder: str, units: list[Unit], prefetch: str, readers: int = 1, *,
                 training_state: TrainingState) -> None:
        super().__init__(units, prefetch, readers)
        self.folder = folder
        self._state = training_state  # through which the parameters' storage moves in and out
        self._order = [u for u in units if u.streamed]  # forward order
        self._views: dict[tuple[int, str], Tensor] = {}
        #: per backward (autograd graph task) under way: unit index -> [gradients due in it, gradients arrived]
        self._backwards: dict[int, dict[int, list[int]]] = {}
        #: called with a unit whose gradients are all in, before it leaves memory (the step in backward, step.py)
        self.unit_ready: Optional[Callable[[Unit], None]] = None
        self._reserve: Optional[Reservation] = None
        self._hooks: list[Any] = []
        #: the model was built into the store (declared on the meta device, or read from pretrained files): it never
        #: gets private memory (teardown leaves its parameters viewing the files)
        self.materialized = False

    def reserve(self, nbytes: int, what: str) -> None:
        """Hold ``nbytes`` of disk now for what the first backward and step will create (``what``: gradients,
        optimizer state; :meth:`pending`): a full disk fails here, at setup, not in the middle of a step."""
        self._reserve = Reservation(self.folder, nbytes, what)

    # ------------------------------------------------------------------ placement

    def pending(self, state_kinds: dict[int, set[tuple[str, torch.dtype]]]) -> tuple[int, int]:
        """Disk bytes of the files the first backward and step will create (store/sizes.py ``pending``)."""
        return pending(self.units, set(self._files), state_kinds)

    def file(self, unit: Unit, kind: str, dtype: torch.dtype) -> MappedFile:
        key = (unit.index, kind)
        f = self._files.get(key)
        if f is None:
            nbytes = file_bytes(unit, dtype)
            if self._reserve is not None:
                self._reserve.take(nbytes)  # the reserved space becomes this file's
            f = self._files[key] = MappedFile(self.folder, f"unit{unit.index}-{kind}-{os.getpid()}.bin", nbytes)
        return f

    def view(self, param: Tensor, kind: str, like: Tensor) -> Tensor:
        """The store's tensor for ``param``'s ``kind`` (shape and dtype of ``like``), created on first use."""
        key = (id(param), kind)
        v = self._views.get(key)
        if v is None or v.shape != like.shape or v.dtype != like.dtype:
            v = self._views[key] = self.file(self.unit_of[id(param)], kind, like.dtype).view(like.shape, like.dtype)
        return v

    def knows(self, param: Tensor) -> bool:
        return id(param) in self.unit_of

    @torch.no_grad()
    def hold(self, param: Tensor, kind: str, tensor: Tensor) -> Tensor:
        """``tensor``'s values in the store's view (returned); a parameter the store does not hold: ``tensor``."""
        if not self.knows(param) or not tensor.is_floating_point():
            return tensor
        v = self.view(param, kind, tensor)
        if v is not tensor:
            v.copy_(tensor)
            self._dirty.add((self.unit_of[id(param)].index, kind))
        return v

    def install(self, root: Optional[nn.Module] = None, pretrained: Sequence[str] = (),
                prefix: Optional[str] = None) -> None:
        """Every held parameter's data moves into the store (same Parameter objects); the hooks that stream the
        weights in forward and store the gradients in backward go on. A ``root`` declared on the meta device is
        built into the store layer by layer instead (store/materialize.py), then the ``pretrained`` safetensors files
        are read into it one tensor at a time (``prefix``: before their names; None: found)."""
        if root is not None and (is_meta(root) or pretrained):
            self._build(root, pretrained, prefix)
        else:
            for u in self.units:
                for p in u.params:
                    self._state.rebind(p, self.hold(p, WEIGHT, p.data))
                self.release(u)
        for u in self.units:
            if u.module is not None:
                self._hooks.append(u.module.register_forward_pre_hook(lambda m, a, u=u: self.before_forward(u)))
                self._hooks.append(u.module.register_forward_hook(lambda m, a, o, u=u: self.after_forward(u)))
                # a checkpoint's weights go in unit by unit: each unit, loaded, is written back and leaves memory
                self._hooks.append(u.module.register_load_state_dict_post_hook(
                    lambda m, keys, u=u: self._leave(u, True, (WEIGHT,))))
        if root is not None:  # the resident unit's weights, loaded, are written back once the whole module is
            resident = self.units[-1]
            self._hooks.append(root.register_load_state_dict_post_hook(
                lambda m, keys: self._leave(resident, True, (WEIGHT,))))
        for p in (p for u in self.units for p in u.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_arrived))

    def _switcher(self) -> Callable[[Optional[Unit]], None]:
        """A function to call with the unit about to be written (None: the end): the last one, written, leaves."""
        current: list[Optional[Unit]] = [None]

        def switch(u: Optional[Unit]) -> None:
            if current[0] is not None and u is not current[0]:
                # the unit before it is on the disk first: dirty pages stay within two units (a memory cgroup's
                # reclaim cannot write them out for it), the last one's write-back overlapping the next one's writes
                self._written()
                self._leave(current[0], True, (WEIGHT,))
            current[0] = u

        return switch

    def _build(self, root: nn.Module, pretrained: Sequence[str], prefix: Optional[str]) -> None:
        """Each held parameter gets its view in the store; a meta-declared ``root`` is materialized into the views
        (its init replayed, layer by layer), then the pretrained tensors are read in."""
        self.materialized = True
        views = [(p, self.view(p, WEIGHT, p)) for u in self.units for p in u.params]
        if is_meta(root):
            unit_by_storage = {p.untyped_storage()._cdata: self.unit_of[id(p)] for p, _ in views if p.is_meta}
            targets = {p.untyped_storage()._cdata: v for p, v in views if p.is_meta}
            for p, v in views:
                if not p.is_meta:
                    v.copy_(p.data)
            materialize(root, targets, unit_by_storage.get, self._switcher())
        else:
            for p, v in views:
                v.copy_(p.data)
        for p, v in views:
            self._state.rebind(p, v)
        for u in self.units:
            self._dirty.add((u.index, WEIGHT))
            self.release(u)
        if pretrained:
            switch = self._switcher()
            read, missing, unexpected = load_pretrained(root, pretrained, prefix,
                                                        lambda t: switch(self.unit_of.get(id(t))))
            log.info(f"state_store: {read} pretrained tensors read from {', '.join(map(str, pretrained))}"
                     + (f"; not in the files (their init kept): {', '.join(missing)}" if missing else "")
                     + (f"; in the files but not in the model (ignored): {', '.join(unexpected)}" if unexpected
                        else ""))

    def new_step(self) -> None:
        """A step boundary: no backward of the last step is under way any more."""
        self._backwards.clear()

    @torch.no_grad()
    def after_step(self, optimizer: Any, params: Iterable[Tensor], parameter_of: Callable[[Tensor], Tensor]) -> None:
        """``params`` (keys of ``optimizer.state``; masters stand for their parameters through ``parameter_of``)
        were just stepped: their per-element optimizer state moves into the store, and their units, written to,
        leave memory."""
        last: Optional[Unit] = None
        for x in params:
            p = parameter_of(x)
            if not self.knows(p):
                continue
            st = optimizer.state.get(x) or {}
            for k, value in list(st.items()):
                if per_element(k, value, x):
                    st[k] = self.hold(p, state_kind(k, value.dtype), value)
            u = self.unit_of[id(p)]
            if last is not None and u is not last:  # one unit in memory at a time (a resume places them all)
                self._settled(last)
            last = u
        if last is not None:
            self._settled(last)

    def _settled(self, u: Unit) -> None:
        self._dirty.update(key for key, _ in self._unit_files(u) if key[1] != GRAD)
        self.release(u)

    # ------------------------------------------------------------------ gradients (backward)

    def _due(self) -> dict[int, list[int]]:
        """The counts of the backward under way, made at its first gradient: per unit, the parameters whose gradient
        this backward will deliver (autograd runs their AccumulateGrad nodes: what torch's ``register_multi_grad_hook``
        asks too). A parameter outside this backward's graph (never used, or not in this micro-batch) is not waited
        for; its gradient, when an earlier micro-batch left one, steps with the unit."""
        task = torch._C._current_graph_task_id()
        counts = self._backwards.get(task)
        if counts is None:
            will_run = torch._C._will_engine_execute_node
            counts = self._backwards[task] = {
                u.index: [sum(p.requires_grad and will_run(get_gradient_edge(p).node) for p in u.params), 0]
                for u in self.units}
        return counts

    def _grad_arrived(self, p: Tensor) -> None:
        if p.grad is None:
            return
        u = self.unit_of[id(p)]
        counts = self._due()
        due = counts[u.index]
        if due[1] == 0:
            self._discard_dead_grads(u)
        p.grad = self.hold(p, GRAD, p.grad)
        due[1] += 1
        if due[1] != due[0]:
            return
        # complete in this backward (it steps, when this is the step's last micro-batch)
        if all(arrived >= n for n, arrived in counts.values()):
            self._backwards.pop(torch._C._current_graph_task_id(), None)
        if u.streamed:  # the unit whose backward comes next (after unit 0: the resident one, its weights mapped)
            nxt = self.units[u.index - 1] if u.index > 0 else self.units[-1]
            if self.unit_ready is not None:  # it steps in backward too: its state comes with its weights
                self.prefetch(nxt, self._kinds(nxt, GRAD))
            elif nxt.streamed:
                self.prefetch(nxt, (WEIGHT,))
        if self.unit_ready is not None:
            self.unit_ready(u)
        self.release(u)  # the unit's backward is over: weights and gradients leave memory

    def _discard_dead_grads(self, u: Unit) -> None:
        """The first gradient of ``u`` in this backward: when no parameter of ``u`` still has its stored gradient
        (``zero_grad`` set them to ``None``; not when gradients accumulate), last step's gradients are dead and the
        new ones overwrite them whole: the file forgets them first, so that writing the new ones reads nothing."""
        f = self._files.get((u.index, GRAD))
        if f is None:
            return
        for q in u.params:
            v = self._views.get((id(q), GRAD))
            if q.grad is not None and v is not None and q.grad.data_ptr() == v.data_ptr():
                return
        f.discard(0, f.used)

    # ------------------------------------------------------------------ forward

    def before_forward(self, u: Unit) -> None:
        backward = torch._C._current_graph_task_id() != -1  # a recompute, inside backward
        nxt = u.index - 1 if backward else u.index + 1
        if 0 <= nxt < len(self._order):
            self.prefetch(self._order[nxt], (WEIGHT,))

    def after_forward(self, u: Unit) -> None:
        backward = torch._C._current_graph_task_id() != -1
        if not backward and torch.is_grad_enabled() and u.index == len(self._order) - 1:
            if self.unit_ready is not None:  # it steps first in backward: its state comes in meanwhile
                self.prefetch(u, self._kinds(u, GRAD, WEIGHT))
            return  # the last unit's backward comes right after the rest of the forward
        if not backward:
            self.release(u, (WEIGHT,))

    # ------------------------------------------------------------------ accounting and teardown

    def nbytes(self) -> dict[str, int]:
        """Bytes the store holds, by kind (``state.*`` summed as ``state``)."""
        out: dict[str, int] = {}
        for (_, kind), f in self._files.items():
            k = "state" if kind.startswith("state.") else kind
            out[k] = out.get(k, 0) + f.nbytes
        return out

    def uninstall(self) -> None:
        """Parameters get private memory back, one unit at a time (the module leaves the fit as it came in). The
        rest (gradients left by the last step, optimizer state, masters) stays in the store's files, unlinked,
        mapped for as long as something holds it."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.drain()
        self.pinned.clear()
        for u in self.units:
            if not self.materialized:  # a model built into the store would be built whole: it keeps its views
                self._state.own_memory(u.params)
            for _, f in self._unit_files(u):
                f.unmap()
        self.drain()
        self._stop_threads()
        if self._reserve is not None:
            self._reserve.take(self._reserve.nbytes)
            self._reserve = None
        for f in self._files.values():
            f.close()


__all__ = ["StateStore"]
