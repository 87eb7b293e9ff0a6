"""ThroughputMFUMonitor: Lightning's ThroughputMonitor, with the CPU's peak measured instead of looked up.

Lightning's ``ThroughputMonitor`` does the counting (samples, items, FLOPs over a rolling window) and reads the
module's ``flops_per_batch`` (use ``lightning.fabric.utilities.measure_flops``). What it lacks on CPU is the peak
an MFU divides by: its table knows GPUs and TPUs only. This subclass measures the peak once per rank, at setup,
after the strategy has pinned the rank's cores and sized its threads: the best of a few square matmuls in the
compute dtype (and in fp32 too, so a bf16 run can be compared against the fp32 peak). A measured peak is lower
than a datasheet's, so the MFU is what this rank's cores can really do, under whatever else runs on them.

It also puts tokens/s (global) in the progress bar and prints a one-line summary every ``summary_every_n_steps``.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_horizon.checks import check_int, is_int, is_number, require

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
        torch.mm(a, b)  # warm-up: packing buffers, thread pool start
        best, deadline, reps = float("inf"), time.perf_counter() + seconds / len(sizes), 0
        while reps < 3 or time.perf_counter() < deadline:
            t = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t)
            reps += 1
        best_flops = max(best_flops, 2 * n**3 / best)
    return best_flops


def compute_dtype_of(precision_plugin: Any) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"``: the dtype the matmuls of a step run in under this precision plugin."""
    compute = getattr(precision_plugin, "compute", None)  # HorizonPrecision: resolved from the ISA
    if compute in _DTYPES:
        return compute
    name = str(getattr(precision_plugin, "precision", "32-true"))
    return "bf16" if name.startswith("bf16") else "fp16" if name.startswith("16") else "fp32"


def _batch_size(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(first.shape[0])


def _batch_tokens(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(first.numel())


class ThroughputMFUMonitor(ThroughputMonitor):
    """Tokens/s, FLOP/s and MFU against a peak measured on this machine; a one-line summary every N steps.

    Args:
        batch_size_fn: samples in a batch; default: the first dimension of the batch's first tensor.
        length_fn: items (tokens) in a batch; default: the number of elements of the batch's first tensor
            (token ids ``(batch, time)``: tokens; a table ``(rows, features)``: pass ``length_fn`` yourself).
        peak_flops: the per-rank peak (FLOP/s) MFU divides by; ``None`` measures it at setup.
        window_size: steps in the rolling window (Lightning's ``Throughput``); figures appear once it is full.
        summary_every_n_steps: print the one-line summary every this many optimizer steps (0: never).
        prog_bar: show global tokens/s (``tok/s``) in the progress bar.
        peak_matmul_sizes: the square matmul sizes whose best call is the measured peak.
    """

    def __init__(
        self,
        batch_size_fn: Optional[Callable[[Any], int]] = None,
        length_fn: Optional[Callable[[Any], int]] = None,
        peak_flops: Optional[float] = None,
        window_size: int = 10,
        summary_every_n_steps: int = 50,
        prog_bar: bool = True,
        peak_matmul_sizes: tuple[int, ...] = (512, 1024, 2048),
    ) -> None:
        check_int("ThroughputMFUMonitor", "window_size", window_size, 2)
        check_int("ThroughputMFUMonitor", "summary_every_n_steps", summary_every_n_steps, 0, " (0: no summary lines)")
        require(bool(peak_matmul_sizes) and all(is_int(n, 64) for n in peak_matmul_sizes), "ThroughputMFUMonitor",
                "peak_matmul_sizes", peak_matmul_sizes, "a non-empty sequence of ints >= 64")
        require(peak_flops is None or is_number(peak_flops, 0, math.inf, include_high=True), "ThroughputMFUMonitor",
                "peak_flops", peak_flops, "a number > 0 or None")
        require(isinstance(prog_bar, bool), "ThroughputMFUMonitor", "prog_bar", prog_bar, "True or False")
        for name, fn in (("batch_size_fn", batch_size_fn), ("length_fn", length_fn)):
            require(fn is None or callable(fn), "ThroughputMFUMonitor", name, fn, "a callable(batch) -> int or None")
        super().__init__(batch_size_fn or _batch_size, length_fn or _batch_tokens, window_size=window_size)
        self.peak_flops_given = peak_flops
        self.summary_every_n_steps, self.prog_bar = summary_every_n_steps, prog_bar
        self.peak_matmul_sizes = tuple(peak_matmul_sizes)
        self.compute_dtype = "fp32"
        #: measured (or given) per-rank peaks in FLOP/s, by dtype name
        self.peaks: dict[str, float] = {}
        #: the latest figures: tokens_per_sec (global), flops_per_sec (per rank), mfu, mfu_vs_fp32_peak
        self.last: dict[str, float] = {}
        self._last_step = -1  # the global step of the last optimizer step seen

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.compute_dtype = compute_dtype_of(trainer.precision_plugin)
        if not self.peaks and trainer.strategy.root_device.type == "cpu":
            self.peaks["fp32"] = measure_matmul_peak(torch.float32, self.peak_matmul_sizes)
            if self.compute_dtype != "fp32":
                self.peaks[self.compute_dtype] = measure_matmul_peak(_DTYPES[self.compute_dtype],
                                                                     self.peak_matmul_sizes)
        if self.peak_flops_given is not None:
            self.peaks[self.compute_dtype] = float(self.peak_flops_given)
        super().setup(trainer, pl_module, stage)  # builds the Throughput objects with Lightning's table value
        self.available_flops = self.peaks.get(self.compute_dtype, self.available_flops)
        for throughput in self._throughputs.values():
            throughput.available_flops = self.available_flops
        if trainer.global_rank == 0 and self.peaks:
            log.info("ThroughputMFUMonitor: measured matmul peak per rank: "
                     + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in self.peaks.items())
                     + f" ({torch.get_num_threads()} threads); MFU is against the {self.compute_dtype} peak")

    @override
    @rank_zero_only
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, *args: Any
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, *args)
        if trainer.global_step == self._last_step:
            return  # no optimizer step in this batch (an accumulation micro-batch)
        self._last_step = trainer.global_step
        metrics = self._throughputs[RunningStage.TRAINING].compute()
        per_rank = metrics.get("device/items_per_sec")
        if per_rank is None:
            return  # the window is not full yet
        self.last = {"tokens_per_sec": per_rank * trainer.world_size}
        flops = metrics.get("device/flops_per_sec")
        if flops is not None:
            self.last["flops_per_sec"] = flops
            if self.available_flops:
                self.last["mfu"] = flops / self.available_flops
            if "fp32" in self.peaks and self.compute_dtype != "fp32":
                self.last["mfu_vs_fp32_peak"] = flops / self.peaks["fp32"]
                pl_module.log("train/device/mfu_vs_fp32_peak", self.last["mfu_vs_fp32_peak"], on_step=True,
                              on_epoch=False, rank_zero_only=True)
        if self.prog_bar:
            pl_module.log("tok/s", self.last["tokens_per_sec"], prog_bar=True, logger=False, on_step=True,
                          on_epoch=False, rank_zero_only=True)
        step = trainer.global_step
        if self.summary_every_n_steps and step % self.summary_every_n_steps == 0:
            log.info(f"step {step}: " + self.summary())

    def summary(self) -> str:
        """The latest figures in one line."""
        if not self.last:
            return "throughput: window not full yet"
        parts = [f"{self.last['tokens_per_sec']:,.0f} tok/s"]
        if "flops_per_sec" in self.last:
            parts.append(f"{self.last['flops_per_sec'] / 1e9:.1f} GFLOP/s per rank")
        if "mfu" in self.last:
            parts.append(f"MFU {100 * self.last['mfu']:.0f}% of {self.compute_dtype} peak"
                         f" {self.available_flops / 1e9:.0f} GFLOP/s")
        if "mfu_vs_fp32_peak" in self.last:
            parts.append(f"{100 * self.last['mfu_vs_fp32_peak']:.0f}% of fp32 peak {self.peaks['fp32'] / 1e9:.0f}")
        return " | ".join(parts)
