"""Gradient sync: ``GradientSync``, the state object DDP hands to every comm hook call, and the hook functions.

``GradientSync`` is built on every rank at the same point (it may create process groups, collectively; for
``auto``, ``GradientSync.with_links`` probes the links first, collective too), registered with
``ddp.register_comm_hook(sync, sync.hook)``, and called by DDP once per bucket, in bucket order, on the thread that
runs backward. All collectives of a bucket are issued from there, in a fixed order, and have completed when the
hook returns its already-completed Future. The one exception is the plain flat allreduce of an fp32 bucket, which,
like DDP's own hook, returns the allreduce's Future so that it overlaps with backward: its continuation only
records a time, it never issues a collective.

The object is also a strategy "part": ``after_optimizer_step`` closes the accounting of the step (and runs
the periodic parameter average), ``state_dict``/``load_state_dict`` carry the error-feedback residuals and the
local-SGD counters through a checkpoint.
"""

import logging
import math
import time
from types import MappingProxyType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_horizon.collectives import algorithms
from lightning_horizon.collectives.accounting import CommAccounting
from lightning_horizon.collectives.comm import Comm
from lightning_horizon.collectives.compression import Codec, ErrorFeedback
from lightning_horizon.collectives.config import CollectivesConfig
from lightning_horizon.collectives.cost_model import BucketPlanner, CostModel
from lightning_horizon.collectives.layout import BucketLayout
from lightning_horizon.collectives.local_sgd import PeriodicSync
from lightning_horizon.collectives.outer import OuterSync
from lightning_horizon.collectives.probe import probe
from lightning_horizon.parts import GRADIENTS, Part
from lightning_horizon.state import TrainingState
from lightning_horizon.topology import Grid, ProcessGroups, Topology

log = logging.getLogger(__name__)

LOG_EVERY_N_STEPS = 100


class GradientSync(Part):
    """Everything the comm hooks need: groups, algorithm choice, error feedback, local SGD, accounting."""

    label = "HorizonStrategy(collectives=...)"
    takes = MappingProxyType({GRADIENTS: "DDP's comm hook on every bucket"})

    def __init__(
        self,
        config: CollectivesConfig,
        groups: ProcessGroups,
        module: torch.nn.Module,
        state: TrainingState,
        links: Optional[CostModel] = None,
    ) -> None:
        """``links``: the link constants ``auto``'s choice of algorithm and ``sync_overlap="auto"``'s of overlap are
        made with, required where one of them is configured (:func:`needs_links`): the config's ``cost_model`` or
        the probe's, as :meth:`with_links` passes them."""
        self.config = config
        self.topology = groups.topology
        needed = needs_links(config, self.topology)
        if needed and links is None:
            raise ValueError(f"GradientSync(collectives={config.collectives!r}, sync_overlap={config.sync_overlap!r})"
                             " decides by the links: pass links= (the cost model), or build it with"
                             " GradientSync.with_links")
        cost_model = links if needed else None
        self.accounting = CommAccounting()
        self._comms(groups)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.codec = Codec(config.compression, config.int8_block) if config.compression else None
        self.error_feedback = ErrorFeedback(named) if self.codec else None
        self.periodic = self._periodic(groups, [p for _, p in named], state, cost_model)
        self._overlapped_seconds: list[float] = []  # appended by flat allreduce continuations (worker threads)
        #: the bucket layout reduced in, kept through checkpoints (see layout.py)
        self.layout = BucketLayout(named)
        # The order gradients become ready in the first backward: DDP rebuilds its buckets from it, and a
        # checkpoint written before the rebuilt buckets were first used reads their layout from it.
        self._ready: list[str] = []
        self._ready_hooks = [
            p.register_post_accumulate_grad_hook(lambda p, n=n: self._ready.append(n)) for n, p in named
        ]
        #: which algorithm (pipeline chunk, compression) reduces each bucket size
        self.planner = BucketPlanner(config, self.topology.num_nodes, self.topology.ranks_per_node, self.torus_cols,
                                     cost_model if config.collectives == "auto" else None, info=self._info)
        self._info(self._describe())

    @classmethod
    def with_links(
        cls, config: CollectivesConfig, groups: ProcessGroups, module: torch.nn.Module, state: TrainingState
    ) -> "GradientSync":
        """Build it with the links its choices need (:func:`sync_links`: given, or probed), on every rank at the
        same point. The torus grid's groups, where it has its own, are created first, collectively: the ranks then
        arrive at the probe together, and its codecs are timed on cores shared as in training."""
        _grid(config, groups)  # created on first request, then cached: the constructor finds them
        return cls(config, groups, module, state, sync_links(config, groups))

    def _comm(self, group: Optional[dist.ProcessGroup], ranks: list[int]) -> Comm:
        return Comm(group, ranks, self.topology, self.accounting)

    def _comms(self, groups: ProcessGroups) -> None:
        """The groups the algorithms run over: the world, the node, across the nodes, and the two-level stages' row
        and column (the node and across it, or the torus grid's)."""
        self.world = self._comm(None, list(range(self.topology.world_size)))
        self.intra = self._comm(groups.intra, groups.intra_ranks)
        self.inter = self._comm(groups.inter, groups.inter_ranks)
        self.torus_cols, grid = _grid(self.config, groups)
        self.row, self.col = self.intra, self.inter
        if grid is not None:
            self.row, self.col = self._comm(grid.row, grid.row_ranks), self._comm(grid.col, grid.col_ranks)

    def _periodic(self, groups: ProcessGroups, params: list[torch.Tensor], state: TrainingState,
                  links: Optional[CostModel]) -> Optional[PeriodicSync]:
        """Local SGD (``sync_every > 1``): the periodic parameter average, with its outer step where configured."""
        config = self.config
        if config.sync_every <= 1:
            return None
        return PeriodicSync(config.sync_every, config.sync_warmup_steps, params, self.intra, self.inter, state,
                            self._outer(groups, params, state, links))

    def _outer(self, groups: ProcessGroups, params: list[torch.Tensor], state: TrainingState,
               links: Optional[CostModel]) -> Optional[OuterSync]:
        """The outer step of a period, where it is not a plain average or the exchange overlaps."""
        config, topo = self.config, self.topology
        if config.outer == "average" and not config.sync_overlap:
            return None
        exchange = None
        if config.sync_overlap == "auto" and links is not None:  # decided at the first sync
            numel = sum(p.numel() for p in params)  # as hierarchical's allreduce of the weights: the same stages
            exchange = links.predict("hierarchical", numel, topo.num_nodes, topo.ranks_per_node).time
        # its own inter-node group: with overlap the exchange is in flight while the steps reduce theirs
        return OuterSync(config.outer, config.outer_lr, config.outer_momentum, config.sync_overlap, params,
                         self.intra, self._comm(groups.spare_inter(), groups.inter_ranks), state, exchange, self._info)

    def _describe(self) -> str:
        """The one line rank 0 logs at construction: algorithm, grid, compression, local SGD."""
        config, topo = self.config, self.topology
        outer = self.periodic.outer if self.periodic is not None else None
        return (
            f"collectives: {config.collectives} on {topo.num_nodes} node(s) x {topo.ranks_per_node} rank(s)"
            + (f", torus {self.torus_cols} x {topo.world_size // self.torus_cols}"
               if config.collectives == "torus2d" else "")
            + f", compression {config.compression}"
            + (f" ({'C kernel' if self.codec.native else 'torch ops'})" if self.codec else "")
            + f", sync_every {config.sync_every}"
            + (f", outer {config.outer}" + (f" (lr {config.outer_lr}, momentum {config.outer_momentum})"
                                            if config.outer == "nesterov" else "")
               + f", overlap {config.sync_overlap}" if outer is not None else "")
        )

    # ------------------------------------------------------------------ the hook

    @property
    def hook(self) -> Callable:
        """The hook function to register with this state (its name shows in DDP's logging data)."""
        if self.periodic is not None:
            return local_sgd_hook
        return HOOKS[self.config.collectives]

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Average the bucket's gradients over the world (or over the node between local-SGD averages).

        After a restart, a bucket that holds several of the checkpoint's buckets (DDP's first iteration puts
        every parameter in one) is reduced as those, one by one, so the step repeats the uninterrupted run's.
        """
        names = self.layout.names(bucket)
        pieces = self.layout.pieces(bucket, names)
        if pieces is None:
            self.layout.record(names, bucket.is_last())
            return self._reduce(bucket)
        buf = bucket.buffer()
        for piece in pieces:
            piece.load(buf)
            self._reduce(piece).wait()
            piece.store(buf)
            self.layout.record(self.layout.names(piece), piece.is_last())
        return _completed(buf)

    def _reduce(self, bucket: Any) -> torch.futures.Future:
        buf = bucket.buffer()
        if self.periodic is not None:
            self.periodic.gradients_reduced()
            if not self.periodic.global_gradients:
                start = time.perf_counter()
                algorithms.flat(buf, self.intra, None, self.intra.size)
                self.accounting.add_seconds(time.perf_counter() - start)
                return _completed(buf)
        algorithm, chunk, compression = self.planner.plan_for(buf.numel())
        # ``auto`` may send a bucket uncompressed: its residual then goes along, exactly, and is cleared below.
        codec = self.codec if compression else None
        if algorithm == "flat" and self.error_feedback is None and not algorithms.narrow(buf):
            return self._flat_overlapped(buf)
        start = time.perf_counter()
        world_size = self.topology.world_size
        # Compression sums and feeds back in fp32: a bucket of bf16 gradients (bf16-true weights) is reduced
        # in an fp32 copy and rounded once at the end.
        x = buf if self.error_feedback is None or buf.dtype == torch.float32 else buf.float()
        if self.error_feedback is not None:
            self.error_feedback.add_to(bucket, x)  # the buffer is overwritten by the result anyway
        if algorithm == "flat":
            error = algorithms.flat(x, self.world, codec, world_size)
        else:
            row, col = (self.intra, self.inter) if algorithm == "hierarchical" else (self.row, self.col)
            error = algorithms.two_level(x, row, col, codec, chunk, world_size)
        if x is not buf:
            buf.copy_(x)
        # A non-finite result (an overflow or NaN on any rank; the result is bitwise the same on every rank, so
        # every rank decides alike) keeps the bucket's previous residual: the step will be skipped, and with it
        # the residual that went into it, which the next step sends again. Storing this step's encoding errors
        # instead would lose that residual, and their non-finite entries would poison every later step. (A finite
        # bucket of the same step cannot know the step will be skipped: it loses one compression error, no more.)
        # One vectorized sum decides: any inf or NaN makes it non-finite (a sum of finite values that overflows
        # counts as non-finite too; the step's fp32 gradient norm is then inf as well), at a fortieth of the time
        # of isfinite(x).all(), which writes a mask as large as the bucket.
        if self.error_feedback is not None and math.isfinite(x.sum().item()):
            self.error_feedback.scatter(bucket, error)
        self.accounting.add_seconds(time.perf_counter() - start)
        return _completed(buf)

    def _flat_overlapped(self, buf: torch.Tensor) -> torch.futures.Future:
        buf.div_(self.world.size)  # as DDP's allreduce_hook: average before summing, same rounding as DDP
        start = time.perf_counter()
        work = self.world.allreduce(buf, async_op=True)
        if work is None:  # a world of one
            return _completed(buf)
        seconds = self._overlapped_seconds

        def done(fut: torch.futures.Future) -> torch.Tensor:
            seconds.append(time.perf_counter() - start)  # no collective here, ever
            return fut.value()[0]

        return work.get_future().then(done)

    # ------------------------------------------------------------------ strategy part

    def after_optimizer_step(self) -> None:
        """Close the step: periodic parameter average (local SGD), then the step's accounting."""
        if self._ready_hooks and self._ready:
            for handle in self._ready_hooks:  # one backward's order is all DDP's rebuild uses
                handle.remove()
            self._ready_hooks = []
            self._ready = list(dict.fromkeys(self._ready))
        if self.periodic is not None:
            start = time.perf_counter()
            if self.periodic.after_optimizer_step():
                self.accounting.add_seconds(time.perf_counter() - start)
        while self._overlapped_seconds:
            self.accounting.add_seconds(self._overlapped_seconds.pop())
        last = self.accounting.end_step()
        steps = self.accounting.steps
        if steps == 1 or steps % LOG_EVERY_N_STEPS == 0:
            self._info(
                f"collectives step {steps}: sent {last.intra_bytes / 2**20:.2f} MiB intra-node,"
                f" {last.inter_bytes / 2**20:.2f} MiB inter-node, {last.seconds * 1e3:.1f} ms in {last.calls} calls"
            )

    def comm_metrics(self) -> dict[str, float]:
        """The last step's bytes per link class and communication time (for monitor callbacks and loggers)."""
        out = self.accounting.metrics()
        if self.periodic is not None:
            out["comm/param_syncs"] = float(self.periodic.syncs)
            if self.periodic.outer is not None:  # what the last outer step waited for its exchange (not hidden)
                out["comm/outer_wait_s"] = self.periodic.outer.waited
        return out

    def teardown(self) -> None:
        if self.periodic is not None and self.periodic.outer is not None:
            self.periodic.outer.drain()  # no collective left in flight when the fit ends

    def scale_error_feedback(self, params: list[torch.Tensor], factor: float) -> None:
        """The step's reduced gradients of ``params`` were clipped by ``factor``: scale their compression residuals
        alike. A residual is the part of the gradient compression could not send, replayed at the next step;
        after clipping, the update used ``factor`` times the gradient, and a residual left at full size would
        land a spike's whole quantization error on the next, healthy step (measured: a step after a 1e6x spike
        had a gradient norm of 86 with bf16 and 772 with int8 compression, against 0.6 without)."""
        if self.error_feedback is not None and factor != 1.0:
            self.error_feedback.scale(params, factor)

    def before_save(self, model: Any) -> None:
        """A part hook: before a checkpoint is written, on every rank."""
        self.settle_layout(model)

    def settle_layout(self, ddp: Any) -> None:
        """Before a checkpoint: make sure the layout saved is the one the next step reduces in.

        After the first backward of a fresh run, DDP has not used its rebuilt buckets yet (it rebuilds them at
        the next forward). Have it rebuild them now and read their layout from their sizes and the gradient
        order they were built from; without it, a run resumed from this checkpoint would reduce its first step
        in one bucket where the uninterrupted run had the rebuilt ones.
        """
        if self.layout.backwards != 1 or self.layout.restored or not self._ready:
            return
        reducer = getattr(ddp, "reducer", None)
        try:
            if reducer is None or not reducer._rebuild_buckets():  # False: DDP does not rebuild (or did already)
                return
            sizes = [b.buffer().numel() for b in reducer._get_zeros_like_grad_buckets()]
        except (AttributeError, RuntimeError) as err:  # private Reducer methods of torch 2.x
            self._info(f"collectives: could not read DDP's rebuilt buckets ({err}); the checkpoint keeps the first")
            return
        if not self.layout.derive(list(dict.fromkeys(self._ready)), sizes):
            self._info("collectives: DDP's rebuilt buckets do not follow the gradient order; the checkpoint keeps"
                       " the first step's layout")

    def state_dict(self) -> dict[str, Any]:
        return {
            "algorithm": self.config.collectives,
            "layout": self.layout.state_dict(),
            "error_feedback": self.error_feedback.state_dict() if self.error_feedback else None,
            "periodic": self.periodic.state_dict() if self.periodic else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("layout"):
            self.layout.load_state_dict(state["layout"])
        for name, part in (("error_feedback", self.error_feedback), ("periodic", self.periodic)):
            saved = state.get(name)
            if part is not None and saved is not None:
                part.load_state_dict(saved)
            elif part is not None or saved is not None:
                self._info(f"collectives: checkpoint {'has no' if saved is None else 'has unused'} {name} state")

    def _info(self, message: str) -> None:
        if self.topology.rank == 0:
            log.info(message)


def _completed(tensor: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def needs_links(config: CollectivesConfig, topology: Topology) -> bool:
    """Whether a choice of ``config`` is made by the links: ``auto``'s algorithm, ``sync_overlap="auto"``'s overlap
    across nodes."""
    return config.collectives == "auto" or (config.sync_overlap == "auto" and topology.num_nodes > 1)


def sync_links(config: CollectivesConfig, groups: ProcessGroups) -> Optional[CostModel]:
    """The links ``GradientSync`` decides with (``None`` where nothing does, :func:`needs_links`): the config's
    ``cost_model``, or probed with its codec (collective: every rank calls it)."""
    topo = groups.topology
    if not needs_links(config, topo):
        return None
    cost_model, source = config.cost_model, "given"
    if cost_model is None:
        codecs = [config.compression] if config.compression else []
        cost_model, source = probe(groups, codecs, config.int8_block), "probed"
    if topo.rank == 0:
        log.info(f"collectives auto: {source} links: {cost_model.describe()}")
    return cost_model


def _grid(config: CollectivesConfig, groups: ProcessGroups) -> tuple[int, Optional[Grid]]:
    """The torus's ranks per row, and its grid where the two-level stages run on one of their own (``torus2d`` or
    ``auto`` with rows that are not the nodes; created collectively on first request, then cached)."""
    topo = groups.topology
    cols = config.grid_shape(topo.world_size, topo.ranks_per_node)[0]
    if config.collectives in ("torus2d", "auto") and cols != topo.ranks_per_node:
        return cols, groups.grid(cols)
    return cols, None


# One function per algorithm, so that DDP's logging data ("comm_hook") names the algorithm in use. Annotations
# are real objects (no `from __future__ import annotations` in this file): DDP compares them to GradBucket.
def flat_hook(state: GradientSync, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.reduce(bucket)


def hierarchical_hook(state: GradientSync, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.reduce(bucket)


def torus2d_hook(state: GradientSync, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.reduce(bucket)


def auto_hook(state: GradientSync, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.reduce(bucket)


def local_sgd_hook(state: GradientSync, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.reduce(bucket)


HOOKS = {"flat": flat_hook, "hierarchical": hierarchical_hook, "torus2d": torus2d_hook, "auto": auto_hook}
