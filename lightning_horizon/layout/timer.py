"""The tuner's probe inside a worker (StepTimer), added to the script's Trainer with ``--trainer.callbacks+=``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_horizon.cpu import machine_busy_seconds
from lightning_horizon.layout.rule import model_sizes, workload
from lightning_horizon.memory.probe import peak_rss

#: where a worker writes its report, and how many of its steps are warm-up (set by the tuner for each worker)
OUT_ENV, WARMUP_ENV = "HORIZON_TUNE_OUT", "HORIZON_TUNE_WARMUP"


class StepTimer(Callback):
    """The tuner's probe inside a worker: rank 0 writes its step-end times, every rank's peak RSS, the share of the
    machine other processes took while it measured, the workload and the model's sizes to ``$HORIZON_TUNE_OUT``
    at the end of fit (JSON)."""

    def __init__(self) -> None:
        self.out = os.environ.get(OUT_ENV)
        self.warmup = int(os.environ.get(WARMUP_ENV, "1"))
        self.ends: list[float] = []
        self.shape: tuple[int, ...] = ()
        self.start = (0.0, 0.0, 0.0)  # wall, machine busy CPU s, own CPU s at the end of the warm-up

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ends.append(time.perf_counter())
        if not self.shape:
            self.shape = tuple(_first_tensor(batch).shape)
        if len(self.ends) == self.warmup:
            self.start = (time.perf_counter(), machine_busy_seconds(), time.process_time())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        import torch
        import torch.distributed as dist

        wall, busy = time.perf_counter() - self.start[0], machine_busy_seconds() - self.start[1]
        mine = [(peak_rss(), time.process_time() - self.start[2])]
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            mine = [(0, 0.0)] * trainer.world_size
            dist.all_gather_object(mine, (peak_rss(), time.process_time() - self.start[2]))
        if trainer.global_rank != 0 or not self.out:
            return
        seq = self.shape[1] if len(self.shape) >= 2 else None
        sizes = model_sizes(pl_module)
        own = sum(cpu_s for _, cpu_s in mine)
        Path(self.out).write_text(json.dumps({
            "ends": self.ends, "ranks": trainer.world_size, "threads": torch.get_num_threads(),
            "peak_rss": [rss for rss, _ in mine],
            "foreign": max(0.0, busy - own) / max(1e-9, wall * len(os.sched_getaffinity(0))),
            "workload": workload(pl_module, self.shape[0] * trainer.world_size, seq),
            "param_bytes": sizes[0], "largest_bytes": sizes[1],
        }))


def _first_tensor(batch: Any) -> Any:
    if hasattr(batch, "shape"):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    raise TypeError(f"StepTimer: no tensor in the batch ({type(batch).__name__})")


__all__ = ["OUT_ENV", "StepTimer", "WARMUP_ENV"]
