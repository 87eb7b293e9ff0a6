"""ThroughputMFUMonitor: tokens/s (samples/s without a sequence axis), FLOP/s and MFU on CPUs, with nothing to add
to the LightningModule.

The counting is Lightning's ``Throughput`` (a rolling window over time, batches, samples and items). What is added
for CPUs and for a first run:

- the peak an MFU divides by is measured once per rank at setup, after the strategy pinned the rank's cores and
  sized its threads: the best of a few square matmuls in the compute dtype (and in fp32, so a bf16 run can be
  compared against the fp32 peak). Lightning's table knows GPUs and TPUs only; a measured peak is lower than a
  datasheet's, so the MFU is what this rank's cores can really do, under whatever else runs on them;
- the FLOPs of a training batch: ``flops_per_batch=`` given to the monitor, else the module's ``flops_per_batch``
  where it has one (Lightning's convention), else counted once by torch's ``FlopCounterMode`` on rank 0's second
  training batch (forward and backward, any recompute included; the first batch plans and warms up). The log says
  which. The first two batches are left out of every figure;
- the figures are printed as one line every ``summary_every_n_steps`` optimizer steps (the Trainer's
  ``log_every_n_steps`` unless given) and once at the end of fit over the whole run, and the progress bar shows
  ``tok/s`` (or ``samples/s``) as an integer.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.callbacks import Callback
from torch.utils.flop_counter import FlopCounterMode
from typing_extensions import override

from lightning_horizon.callbacks.interval import check_interval
from lightning_horizon.checks import check_int, is_int, is_number, require

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)  # token ids, not values
_PER_RANK = ("device/flops_per_sec", "device/mfu", "device/mfu_vs_fp32_peak")
_SOURCES = {"monitor": "given to the monitor", "module": "the module's flops_per_batch", "counted": "counted on batch 2"}
_SKIPPED = 2  # batches left out of the figures: the first (plans, warms up), the second (its FLOPs are counted)


def measure_matmul_peak(
    dtype: torch.dtype = torch.float32, sizes: Sequence[int] = (512, 1024, 2048), seconds: float = 0.6
) -> float:
    """FLOP/s of the best square matmul in ``dtype`` over ``sizes``, about ``seconds`` in all (3 calls at least per size).

    The best, not the median: on a shared machine the median measures the neighbours; the best single call is the
    closest to what the cores can do, so MFU figures err on the low side. Several sizes, because the size that
    reaches the peak grows with the core count (a 512 matmul is enough for 2 cores, not for 64).
    """
    require(bool(sizes) and all(is_int(n, 64) for n in sizes), "measure_matmul_peak", "sizes", sizes,
            "a non-empty sequence of ints >= 64 (smaller ones measure overhead)")
    best_flops = 0.0
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        best_flops = max(best_flops, 2 * n**3 / fastest_call(lambda: torch.mm(a, b), seconds=seconds / len(sizes)))
    return best_flops


def fastest_call(fn: Callable[[], Any], calls: int = 3, seconds: float = 0.0) -> float:
    """Seconds of the fastest call of ``fn``: after one warm-up call (packing buffers, the thread pool's start), at
    least ``calls`` calls, and more until ``seconds`` have passed. The fastest, for the reason given in
    :func:`measure_matmul_peak`."""
    fn()
    best, deadline, done = float("inf"), time.perf_counter() + seconds, 0
    while done < calls or time.perf_counter() < deadline:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        done += 1
    return best


def compute_dtype_of(precision_plugin: Any) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"``: the dtype the matmuls of a step run in under this precision plugin."""
    compute = getattr(precision_plugin, "compute", None)  # HorizonPrecision: resolved from the ISA
    if compute in _DTYPES:
        return compute
    name = str(getattr(precision_plugin, "precision", "32-true"))
    return "bf16" if name.startswith("bf16") else "fp16" if name.startswith("16") else "fp32"


def _giga(x: float) -> str:
    g = x / 1e9
    return f"{g:,.1f}" if g >= 1 else f"{g:.3g}"


def _percent(share: float) -> str:
    p = 100 * share
    return f"{p:.0f}%" if p >= 1 else f"{p:.2g}%"


def _first_tensor(batch: Any) -> Optional[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _batch_size(batch: Any) -> int:
    first = _first_tensor(batch)
    return int(first.shape[0]) if first is not None and first.dim() else 1


def _batch_tokens(batch: Any) -> Optional[int]:
    """Tokens in a batch whose first tensor holds token ids ``(batch, time)``; None for any other batch."""
    first = _first_tensor(batch)
    if first is None or first.dim() != 2 or first.dtype not in _ID_DTYPES:
        return None
    return int(first.numel())


class ThroughputMFUMonitor(Callback):
    """Tokens/s (or samples/s), FLOP/s and MFU against a peak measured on this machine; one line every N steps.

    Args:
        batch_size_fn: samples in a batch; default: the first dimension of the batch's first tensor.
        length_fn: tokens in a batch; default: the elements of the batch's first tensor when it holds token ids
            ``(batch, time)`` (an integer tensor of two dimensions), else none: figures are then samples/s.
        peak_flops: the per-rank peak (FLOP/s) MFU divides by; ``None`` measures it at setup.
        flops_per_batch: FLOPs of one training batch on one rank; ``None``: the module's ``flops_per_batch`` where
            it has one, else counted once with torch's FlopCounterMode; ``0``: no FLOP/s and no MFU.
        window_size: batches in the rolling window (Lightning's ``Throughput``); figures appear once it is full.
        summary_every_n_steps: print the one-line summary every this many optimizer steps; ``None``: the Trainer's
            ``log_every_n_steps``; 0: never (nor at the end of fit).
        prog_bar: show global tokens/s (``tok/s``), or samples/s, in the progress bar.
        peak_matmul_sizes: the square matmul sizes whose best call is the measured peak.
    """

    def __init__(
        self,
        batch_size_fn: Optional[Callable[[Any], int]] = None,
        length_fn: Optional[Callable[[Any], int]] = None,
        peak_flops: Optional[float] = None,
        flops_per_batch: Optional[float] = None,
        window_size: int = 10,
        summary_every_n_steps: Optional[int] = None,
        prog_bar: bool = True,
        peak_matmul_sizes: tuple[int, ...] = (512, 1024, 2048),
    ) -> None:
        check_int("ThroughputMFUMonitor", "window_size", window_size, 2)
        check_interval("ThroughputMFUMonitor", "summary_every_n_steps", summary_every_n_steps, 0)
        require(bool(peak_matmul_sizes) and all(is_int(n, 64) for n in peak_matmul_sizes), "ThroughputMFUMonitor",
                "peak_matmul_sizes", peak_matmul_sizes, "a non-empty sequence of ints >= 64")
        require(peak_flops is None or is_number(peak_flops, 0, math.inf, include_high=True), "ThroughputMFUMonitor",
                "peak_flops", peak_flops, "a number > 0 or None")
        require(flops_per_batch is None or is_number(flops_per_batch, 0, include_low=True), "ThroughputMFUMonitor",
                "flops_per_batch", flops_per_batch, "a finite number >= 0 (0: no MFU) or None (counted)")
        require(isinstance(prog_bar, bool), "ThroughputMFUMonitor", "prog_bar", prog_bar, "True or False")
        for name, fn in (("batch_size_fn", batch_size_fn), ("length_fn", length_fn)):
            require(fn is None or callable(fn), "ThroughputMFUMonitor", name, fn, "a callable(batch) -> int or None")
        self.batch_size_fn = batch_size_fn or _batch_size
        self.length_fn = length_fn or _batch_tokens
        self.window_size = window_size
        self.peak_flops_given, self.flops_given = peak_flops, flops_per_batch
        self.summary_every_n_steps, self.prog_bar = summary_every_n_steps, prog_bar
        self.peak_matmul_sizes = tuple(peak_matmul_sizes)
        self.compute_dtype = "fp32"
        #: measured (or given) per-rank peaks in FLOP/s, by dtype name
        self.peaks: dict[str, float] = {}
        self.available_flops: Optional[float] = None
        #: FLOPs of one training batch on rank 0 as counted, and where the figure comes from (a key of _SOURCES)
        self.flops_per_batch: Optional[float] = None
        self.flops_from = "counted"
        #: the latest figures: tokens_per_sec or samples_per_sec (global), flops_per_sec (per rank), mfu,
        #: mfu_vs_fp32_peak
        self.last: dict[str, float] = {}
        self._reset()

    def _reset(self) -> None:
        self._throughput = Throughput(world_size=1, window_size=self.window_size)
        self._counter: Optional[tuple[FlopCounterMode, Any]] = None
        self._seen = self._batches = self._samples = self._items = 0
        self._tokens = True  # until a batch without a sequence axis is seen
        self._t0: Optional[float] = None
        self._val_start: Optional[float] = None
        self._last_step = self._step0 = -1

    @property
    def unit(self) -> str:
        """``"tok/s"`` when the batches have a sequence axis (or a ``length_fn`` counts their items), else
        ``"samples/s"``."""
        return "tok/s" if self._tokens else "samples/s"

    # ------------------------------------------------------------------ fit start: the peak

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # after the strategy's setup: the rank's threads are pinned and the precision plugin has seen the model
        # (HorizonPrecision's "auto" computes in fp32 on narrow matmuls)
        self.compute_dtype = compute_dtype_of(trainer.precision_plugin)
        if not self.peaks and trainer.strategy.root_device.type == "cpu" and self.peak_flops_given is None:
            self.peaks["fp32"] = measure_matmul_peak(torch.float32, self.peak_matmul_sizes)
            if self.compute_dtype != "fp32":
                self.peaks[self.compute_dtype] = measure_matmul_peak(_DTYPES[self.compute_dtype],
                                                                     self.peak_matmul_sizes)
        if self.peak_flops_given is not None:
            self.peaks[self.compute_dtype] = float(self.peak_flops_given)
        self.available_flops = self.peaks.get(self.compute_dtype) or get_available_flops(
            trainer.strategy.root_device, _DTYPES[self.compute_dtype])
        if trainer.global_rank == 0 and self.peaks and self.peak_flops_given is None:
            log.info("ThroughputMFUMonitor: measured matmul peak per rank: "
                     + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in self.peaks.items())
                     + f" ({torch.get_num_threads()} threads); MFU is against the {self.compute_dtype} peak")

    # ------------------------------------------------------------------ the training batches (rank 0)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._reset()
        self._throughput = Throughput(world_size=trainer.world_size, window_size=self.window_size)
        # after the module's setup, where a module that counts its own FLOPs sets flops_per_batch
        self.flops_from = ("monitor" if self.flops_given is not None
                           else "module" if getattr(pl_module, "flops_per_batch", None) is not None else "counted")

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_rank == 0 and self._seen == _SKIPPED - 1 and self.flops_from == "counted":
            # the mode sees every op of the step, backward included: one batch, once per fit
            # the batch runs eagerly under force_eager: dynamo refuses a frame under a dispatch mode and marks its
            # code "skip" for good (a torch.compile'd model would then run eagerly for the rest of the fit)
            self._counter = (FlopCounterMode(display=False), torch.compiler.set_stance("force_eager"))
            for mode in self._counter:
                mode.__enter__()

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank != 0:
            return
        self._seen += 1
        counted = self._stop_counting()
        if counted is not None:
            self.flops_per_batch = float(counted) or None
            log.info(f"ThroughputMFUMonitor: {_giga(counted)} GFLOP per batch on rank 0, counted by torch's"
                     " FlopCounterMode on training batch 2 (forward and backward, any recompute included); give the"
                     " monitor flops_per_batch to skip the count"
                     if counted else "ThroughputMFUMonitor: no matmul or convolution counted in a training batch:"
                     " no FLOP/s or MFU (give flops_per_batch to the monitor)")
        items = self.length_fn(batch)
        self._tokens = self._tokens and items is not None
        if self._seen <= _SKIPPED:
            self._t0, self._step0 = time.perf_counter(), trainer.global_step
            return
        self._batches += 1
        self._samples += self.batch_size_fn(batch)
        self._items += items or 0
        self._throughput.update(time=time.perf_counter() - self._t0, batches=self._batches, samples=self._samples,
                                lengths=self._items if self._tokens else None)
        if trainer.global_step == self._last_step:
            return  # no optimizer step in this batch (an accumulation micro-batch)
        self._last_step = trainer.global_step
        figures = self._figures(self._throughput.compute(), pl_module)
        if not figures:
            return  # the window is not full yet
        for name, value in figures.items():
            pl_module.log(f"train/{name}", value, on_step=True, on_epoch=False, rank_zero_only=True)
        rate = "tokens_per_sec" if self._tokens else "samples_per_sec"
        self.last = {rate: self._rate(figures), **{k[len("device/"):]: v for k, v in figures.items()
                                                   if k in _PER_RANK}}
        if self.prog_bar:
            # digits in Lightning's bar: self.log would make it a float tensor (4.29e+3), and tqdm prints a number in
            # whichever form is shorter (20000 as 2e+4); a string it prints as it is
            trainer.progress_bar_metrics[self.unit] = str(round(self.last[rate]))
        every = self._summary_every(trainer)
        if every and trainer.global_step % every == 0:
            log.info(f"step {trainer.global_step}: " + self.summary())

    def _figures(self, metrics: dict[str, float], pl_module: Any) -> dict[str, float]:
        per_rank_batches = metrics.get("device/batches_per_sec")
        if per_rank_batches is None:
            return {}
        out = {k: float(v) for k, v in metrics.items() if k.endswith("_per_sec")}
        flops = self._flops(pl_module)
        if flops:
            out["device/flops_per_sec"] = per_rank_batches * flops
            if self.available_flops:
                out["device/mfu"] = out["device/flops_per_sec"] / self.available_flops
            if "fp32" in self.peaks and self.compute_dtype != "fp32":
                out["device/mfu_vs_fp32_peak"] = out["device/flops_per_sec"] / self.peaks["fp32"]
        return out

    def _flops(self, pl_module: Any) -> Optional[float]:
        """FLOPs of one training batch on rank 0, from the source chosen at the start of fit."""
        if self.flops_given is not None:
            return self.flops_given
        if self.flops_from == "module":
            module = getattr(pl_module, "flops_per_batch", None)  # a property may change with the batch
            return None if module is None else float(module)
        return self.flops_per_batch

    def _rate(self, figures: dict[str, float]) -> float:
        """Global tokens/s (or samples/s)."""
        key = "items_per_sec" if self._tokens else "samples_per_sec"
        return figures.get(key, figures.get(f"device/{key}", 0.0))

    def _summary_every(self, trainer: "pl.Trainer") -> int:
        return trainer.log_every_n_steps if self.summary_every_n_steps is None else self.summary_every_n_steps

    def _stop_counting(self) -> Optional[int]:
        """Close the FLOP count if one is open: the FLOPs it counted, else None."""
        if self._counter is None:
            return None
        (counter, eager), self._counter = self._counter, None
        eager.__exit__(None, None, None)
        counter.__exit__(None, None, None)
        return counter.get_total_flops()

    # ------------------------------------------------------------------ validation time is not training time

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._val_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._t0 is not None and self._val_start is not None and not trainer.sanity_checking:
            self._t0 += time.perf_counter() - self._val_start
        self._val_start = None

    # ------------------------------------------------------------------ the end of fit

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.global_rank != 0 or not self._batches or self._t0 is None or self._summary_every(trainer) == 0:
            return
        seconds = time.perf_counter() - self._t0
        steps = trainer.global_step - self._step0
        rate = (self._items if self._tokens else self._samples) * trainer.world_size / seconds
        parts = [f"{rate:,.0f} {self.unit}"]
        flops = self._flops(pl_module)
        if flops:
            per_rank = self._batches * flops / seconds
            parts.append(f"{_giga(per_rank)} GFLOP/s per rank ({_SOURCES[self.flops_from]})")
            if self.available_flops:
                parts.append(f"MFU {_percent(per_rank / self.available_flops)} of {self.compute_dtype} peak")
        log.info(f"fit: {steps} step{'s' * (steps != 1)} after {_SKIPPED} warm-up batches in {seconds:,.1f} s: "
                 + " | ".join(parts))

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._stop_counting()

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._stop_counting()
        if stage == "fit":
            trainer.progress_bar_metrics.pop(self.unit, None)

    def summary(self) -> str:
        """The latest figures in one line."""
        if not self.last:
            return "throughput: window not full yet"
        rate = self.last.get("tokens_per_sec", self.last.get("samples_per_sec", 0.0))
        parts = [f"{rate:,.0f} {self.unit}"]
        if "flops_per_sec" in self.last:
            parts.append(f"{_giga(self.last['flops_per_sec'])} GFLOP/s per rank")
        if "mfu" in self.last:
            parts.append(f"MFU {_percent(self.last['mfu'])} of {self.compute_dtype} peak"
                         f" {self.available_flops / 1e9:.0f} GFLOP/s")
        # the fp32 peak's share stays a logged figure (device/mfu_vs_fp32_peak) only: above 100% of a peak reads as
        # an error, and the compute dtype's peak is the one this run can reach
        return " | ".join(parts)
