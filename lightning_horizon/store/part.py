"""OutOfCore: ``HorizonStrategy(state_store=...)`` on one rank, a strategy part.

It plans the units (units.py), creates the fit's subfolder (folder.py) and the store and moves the weights in
(store.py) before the optimizers and the precision plugin exist, so that masters and optimizer state are born into
it; once the optimizers exist it reserves the disk for what the first step creates (the gradients and the state the
optimizers keep, reserve.py), measures the disk, replaces each optimizer's step by the layer-by-layer one (step.py)
and logs the plan table. After every optimizer step it reads what went to and from the disk (``/proc/self/io``).
Teardown gives the parameters private memory back and removes the subfolder.
"""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any, Callable, Optional

from torch import nn

from lightning_horizon.memory.probe import current_rss, fmt_bytes, node_free_memory
from lightning_horizon.optim import torch_optimizer
from lightning_horizon.parts import PARAMETERS, Part
from lightning_horizon.state import TrainingState
from lightning_horizon.store.config import StoreConfig
from lightning_horizon.store.folder import FitFolder
from lightning_horizon.store.probe import DiskBandwidth, disk_bandwidth, probe_size
from lightning_horizon.store.reserve import describe, merge, state_kinds
from lightning_horizon.store.step import StreamedStep, backward_step_conflicts, why_not
from lightning_horizon.store.files import io_counters
from lightning_horizon.store.store import StateStore
from lightning_horizon.store.units import plan_units

log = logging.getLogger(__name__)

#: units' weights are pinned while the measured peak plus twice the next unit's weights stays below this fraction
#: of the sharding budget (the sharder re-plans above its headroom, 0.95 by default)
PIN_BELOW = 0.85


class OutOfCore(Part):
    """The out-of-core store of one rank and what it measures."""

    label = "HorizonStrategy(state_store=...)"
    takes = MappingProxyType({PARAMETERS: "the weights, masters and optimizer state in files, streamed per layer"})
    #: its step hook reads the sharder's measured peak of the step before the sharder measures the next one
    runs_before = ("sharding",)

    def __init__(self, config: StoreConfig, training_state: TrainingState, rank: int,
                 sharder: Callable[[], Any] = lambda: None, budgeted: bool = False,
                 budget_bytes: Optional[int] = None) -> None:
        self.config = config
        self.budget_bytes = budget_bytes  # the sharding budget in bytes, where given so
        self.budgeted = budgeted  # a sharding budget exists: units may be pinned as measured memory allows
        self._sharder = sharder  # the strategy's GraphSharder, once it exists: the budget and the measured peak
        self._changed_at = -2  # the sharder's step count when the pinned units last changed
        self.training_state = training_state
        self.rank = rank
        self.store: Optional[StateStore] = None
        self._folder: Optional[FitFolder] = None
        self.folder: Optional[str] = None  # this fit's subfolder, where the files are
        self.state_kinds = ""  # the per-element state each optimizer keeps, as learned at setup
        #: disk bytes reserved at setup for the gradients and the optimizer state the first step creates
        self.reserved: tuple[int, int] = (0, 0)
        self.disk: Optional[DiskBandwidth] = None  # measured at setup
        self._steps: list[StreamedStep] = []
        self._load_hooks: list[Any] = []
        self._io = io_counters("/proc/self/io")
        #: the last optimizer step's bytes read from and written to the disk by this process (``/proc/self/io``), and
        #: the reading threads' achieved bandwidth over that step (bytes/s, by kind of read: see metrics())
        self.last_read = 0
        self.last_written = 0
        self.last_read_bw: dict[str, float] = {}
        self.in_backward = False  # the optimizer step runs in backward, each unit as its gradients are complete
        self.step_reason = ""  # why it runs after backward
        self._reads: dict[str, tuple[float, float]] = {}

    def install(self, module: nn.Module, folder: str) -> None:
        """Before the optimizers and the precision plugin connect: the weights move into the store, in a subfolder of
        ``folder`` of this fit's own (store/folder.py)."""
        self.check_built(module)
        self._folder = FitFolder(folder, self.rank)
        self.folder = self._folder.path
        self.store = StateStore(self.folder, plan_units(module), self.config.prefetch, self.config.readers,
                                training_state=self.training_state)
        try:
            self.store.install(module, self.config.pretrained_paths, self.config.pretrained_prefix)
        except BaseException:  # the part is not in the fit yet: no teardown will come for it
            self.teardown()
            raise
        self.training_state.store = self.store

    def check_built(self, module: nn.Module) -> None:
        """A model whose ``__init__`` built its weights in memory fails here when they cannot fit: more than the
        sharding budget, or than this process may have (its cgroup's room, the machine's available memory)."""
        built = sum(p.numel() * p.element_size() for p in dict.fromkeys(module.parameters()) if not p.is_meta)
        room = current_rss() + node_free_memory()
        sharder_budget = self.budget_bytes
        limit, what = (sharder_budget, "the sharding budget") if sharder_budget is not None and sharder_budget < room \
            else (room, "the memory this process may have")
        if built > limit:
            raise MemoryError(
                f"state_store: {type(module).__name__}'s __init__ built its weights in memory ({fmt_bytes(built)}),"
                f" more than {what} ({fmt_bytes(limit)}): declare the model in configure_model or under"
                " trainer.init_module(empty_init=True), and the store builds it layer by layer on disk")

    def refuses(self, optimizer: Any) -> Optional[str]:
        return why_not(optimizer)

    def connect(self, trainer: Any, module: nn.Module, optimizers: list[Any]) -> None:
        """Once the optimizers exist: when the step runs (the trainer and its precision plugin say what is in the way
        of stepping in backward), reserve, probe, the layer-by-layer step, the plan table."""
        precision = trainer.precision_plugin
        store = self.store
        assert store is not None and self.folder is not None
        conflicts = backward_step_conflicts(trainer, optimizers, precision)
        if self.config.step == "in_backward" and conflicts:
            raise ValueError(f"StoreConfig(step='in_backward') cannot run this fit's optimizer step in backward:"
                             f" {'; '.join(conflicts)}. Use step='auto' (after backward here) or 'after_backward'")
        self.in_backward = self.config.step != "after_backward" and not conflicts
        self.step_reason = ("" if self.in_backward else
                            "asked for" if self.config.step == "after_backward" else "; ".join(conflicts))
        # the disk for what the first backward and step create: gradients, and the state this optimizer keeps
        kinds = merge([state_kinds(opt, self.training_state) for opt in optimizers])
        self.state_kinds = describe(optimizers, kinds)
        grads, state = store.pending(kinds)
        self.reserved = (grads, state)
        store.reserve(grads + state, f"the gradients and the optimizer state ({self.state_kinds})")
        if self.config.probe_bytes:
            size = probe_size(self.folder, self.config.probe_bytes)
            if size < self.config.probe_bytes and self.rank == 0:
                log.info(f"state_store: the disk probe writes 2 x {fmt_bytes(size)}, not the asked"
                         f" 2 x {fmt_bytes(self.config.probe_bytes)}: what {self.folder} has room for")
            self.disk = disk_bandwidth(self.folder, size)
        for opt in optimizers:
            opt = torch_optimizer(opt)
            self._steps.append(StreamedStep(opt, store, self.training_state, self.in_backward))
            # a loaded optimizer state (resume) goes into the store at once, not at the first step
            self._load_hooks.append(opt.register_load_state_dict_post_hook(
                lambda o: store.after_step(o, list(o.state), self.training_state.parameter_of)))
        self._io = io_counters("/proc/self/io")
        if self.rank == 0:
            log.info(self.table(grads, state))

    def table(self, grads: int, state: int) -> str:
        store = self.store
        assert store is not None
        streamed = [u for u in store.units if u.streamed]
        resident = store.units[-1]
        held = store.nbytes()
        w_streamed = sum(u.nbytes for u in streamed)
        weights = held.get("weight", 0)
        extra = sum(v for k, v in held.items() if k not in ("weight", "grad"))
        # per step: weights in forward and again in backward, gradients out (over last step's, which are not read
        # back), the step reads weights, gradients, masters and state (in backward: the state only, the rest is in
        # memory then), and writes weights, masters and state; a gradient norm (HorizonPrecision, GradNormBackoff)
        # reads the gradients once more, a clip reads and writes them
        read = 2 * w_streamed + (0 if self.in_backward else weights + grads) + extra + state
        written = grads + weights + extra + state
        lines = [
            f"out-of-core store: {store.folder} (prefetch={store.prefetch_mode})",
            f"  streamed: {len(streamed)} units"
            + (f" ({streamed[0].name} .. {streamed[-1].name}, up to {fmt_bytes(max(u.nbytes for u in streamed))}"
               " of weights each; one in use, the next read ahead)" if streamed else ""),
            f"  resident: {len(resident.params)} parameters, {fmt_bytes(resident.nbytes)} of weights (used by the"
            " modules outside the units: embeddings, head); their gradients and state are streamed",
            f"  store: weights {fmt_bytes(weights)}, masters/compensation {fmt_bytes(extra)};"
            f" reserved for gradients {fmt_bytes(grads)} and optimizer state {fmt_bytes(state)} ({self.state_kinds})",
            f"  per optimizer step (estimate): read {fmt_bytes(read)}, written {fmt_bytes(written)}; a gradient norm"
            f" reads {fmt_bytes(grads)} more, a clip reads and writes {fmt_bytes(grads)} more",
            "  step: " + ("in backward, each unit as soon as its gradients are complete (its weights and gradients"
                          " still in memory)" if self.in_backward else
                          f"after backward, unit by unit (not in backward: {self.step_reason})"),
            "  pinned: " + (f"units' weights stay mapped while the measured peak leaves room under {PIN_BELOW:.0%}"
                            " of the sharding budget, the last units first" if self.budgeted else
                            "none (no sharding budget: every unit streams)"),
        ]
        if self.disk is not None:
            r, w, rw = self.disk
            lines.append(f"  disk (measured): read {r / 1e6:.0f} MB/s ({rw / 1e6:.0f} MB/s while writing),"
                         f" write {w / 1e6:.0f} MB/s ->"
                         f" {read / r + written / w:.2f} s of disk time per step, hidden behind compute as far as the"
                         " step is longer")
        return "\n".join(lines)

    def after_optimizer_step(self) -> None:
        r, w = io_counters("/proc/self/io")
        self.last_read, self.last_written = r - self._io[0], w - self._io[1]
        self._io = (r, w)
        if self.store is not None:
            reads = {k: tuple(v) for k, v in self.store.reads.items()}
            reads["all"] = tuple(map(sum, zip(*reads.values())))
            last = {k: (n - self._reads.get(k, (0, 0.0))[0], t - self._reads.get(k, (0, 0.0))[1])
                    for k, (n, t) in reads.items()}
            self.last_read_bw = {k: n / t for k, (n, t) in last.items() if t > 0}
            self._reads = reads
        self._follow_memory()

    def _follow_memory(self) -> None:
        """With a sharding budget, keep units' weights mapped (no reads of them) while the measured peak leaves room
        below ``PIN_BELOW`` x budget, one unit at a time, the last units first (their weights are used soonest
        again); give one back when the peak passes the sharder's headroom. Every change waits for a step measured
        with it (the sharder measures each step's peak after this hook)."""
        sharder, store = self._sharder(), self.store
        if sharder is None or store is None or sharder.budget is None or sharder.last_peak is None:
            return
        if sharder.steps < self._changed_at + 2:
            return
        budget, peak = sharder.budget, sharder.last_peak
        free = [u for u in reversed(store.units) if u.streamed and u.index not in store.pinned]
        pinned = [u for u in store.units if u.index in store.pinned]
        if peak > sharder.config.headroom * budget and pinned:
            unit, what = pinned[0], "released"
            store.unpin(unit)
        elif free and peak + 2 * free[0].nbytes <= PIN_BELOW * budget:
            unit, what = free[0], "pinned"
            store.pin(unit)
        else:
            return
        self._changed_at = sharder.steps
        log.info(f"state_store[rank {self.rank}]: {what} the weights of {unit.name} ({fmt_bytes(unit.nbytes)}):"
                 f" measured peak {fmt_bytes(peak)} = {peak / budget:.0%} of the budget {fmt_bytes(budget)};"
                 f" {len(store.pinned)} of {len(store.units) - 1} units pinned")

    def metrics(self) -> dict[str, float]:
        """The last step's disk bytes, units pinned, and the reading threads' achieved bandwidth over the step (bytes
        over the wall time the threads were reading; ``prefetch="read"`` only: a read-ahead's time is the kernel's):
        ``read_bw`` all reads, against the disk's measured read bandwidth (``read_bw_fraction``); ``read_bw_alone``
        the reads during which no write-back ran, against the same; ``read_bw_shared`` those that shared the disk
        with a write-back, against the read bandwidth measured while writing."""
        store = self.store
        out: dict[str, float] = {"bytes_read": self.last_read, "bytes_written": self.last_written,
                                 "pinned_units": len(store.pinned) if store is not None else 0}
        for k, bw in self.last_read_bw.items():
            name = "read_bw" if k == "all" else f"read_bw_{k}"
            out[name] = bw
            if self.disk is not None:  # reads that shared the disk with a write-back: against the same measured
                out[f"{name}_fraction"] = bw / (self.disk.shared_read if k == "shared" else self.disk.read)
        return out

    def teardown(self) -> None:
        for h in self._load_hooks:
            h.remove()
        self._load_hooks.clear()
        for s in reversed(self._steps):
            s.remove()
        self._steps.clear()
        if self.store is not None:
            self.store.uninstall()
            self.store = None
        self.training_state.store = None
        if self._folder is not None:
            self._folder.remove()  # empty: every file was unlinked at creation
            self._folder = None


__all__ = ["OutOfCore"]
