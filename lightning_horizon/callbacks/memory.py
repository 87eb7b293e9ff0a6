"""MemoryMonitor: resident memory, its peak, and the machine's available memory, for every rank.

On CPU the model, the activations and the allocator's slack all live in the process's resident set, so RSS is the
number that decides whether a run fits; the peak (the RSS high-water mark) shows what the worst step needed, and
"available" what is left on the machine (ranks on one machine share it). Every rank measures itself; the figures
are gathered to rank 0, which logs them per rank (``mem/rank{r}/...``) and as the maximum over ranks (``mem/...``).

The figures are the probes of ``lightning_horizon/memory/probe.py``, the ones the sharder and the fit check read:
the peak is the high-water mark (``VmHWM``), which the sharder resets right after every optimizer step to measure
each step (with sharding on, the peak logged here covers only what followed that reset; Linux lowers ``ru_maxrss``
with it too), and "available" is the node's free memory as the budget sees it (a cgroup limit tighter than the
kernel's available memory counts; ``HORIZON_AVAILABLE_MEMORY`` overrides it).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_horizon.callbacks.interval import check_interval
from lightning_horizon.memory.probe import current_rss, node_free_memory, peak_rss

log = logging.getLogger(__name__)

_MIB = 2**20
_FIELDS = ("rss_mib", "peak_rss_mib", "available_mib")


def memory_now() -> dict[str, float]:
    """This process's RSS and peak RSS, and the machine's available memory, in MiB."""
    return {
        "rss_mib": current_rss() / _MIB,
        "peak_rss_mib": peak_rss() / _MIB,
        "available_mib": node_free_memory() / _MIB,
    }


def _all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (plain torch.distributed: Lightning's all_gather goes through a deprecated autograd op)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [t]
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


class MemoryMonitor(Callback):
    """Log RSS, peak RSS and available memory per rank every ``log_every_n_steps``; summarize every N steps.

    Args:
        log_every_n_steps: measure, gather and log every this many optimizer steps (a tiny all-gather each time);
            ``None``: the Trainer's ``log_every_n_steps``.
        summary_every_n_steps: print a one-line summary every this many steps (a multiple of
            ``log_every_n_steps`` is printed; 0: never); ``None``: every ``log_every_n_steps``.
    """

    def __init__(self, log_every_n_steps: Optional[int] = None, summary_every_n_steps: Optional[int] = None) -> None:
        check_interval("MemoryMonitor", "log_every_n_steps", log_every_n_steps, 1)
        check_interval("MemoryMonitor", "summary_every_n_steps", summary_every_n_steps, 0)
        self.log_every_n_steps, self.summary_every_n_steps = log_every_n_steps, summary_every_n_steps
        #: the latest figures of every rank: one dict per rank (on rank 0; other ranks hold their own only)
        self.last: list[dict[str, float]] = []
        self._last_step = -1

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, every = trainer.global_step, self.log_every_n_steps or trainer.log_every_n_steps
        # once per optimizer step (accumulation micro-batches share the step), at the same step on every rank:
        # the gather below is a collective
        if step == self._last_step or step % every:
            return
        self._last_step = step
        mine = memory_now()
        local = torch.tensor([mine[k] for k in _FIELDS], dtype=torch.float64)
        rows = [r.tolist() for r in _all_gather(local)]
        self.last = [dict(zip(_FIELDS, r)) for r in rows]
        metrics = {f"mem/{k}": max(r[k] for r in self.last) for k in _FIELDS}
        metrics["mem/available_mib"] = min(r["available_mib"] for r in self.last)  # the tightest machine
        if len(self.last) > 1:
            metrics.update({f"mem/rank{i}/{k}": v for i, r in enumerate(self.last) for k, v in r.items()})
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, rank_zero_only=True)
        summary = every if self.summary_every_n_steps is None else self.summary_every_n_steps
        if trainer.global_rank == 0 and summary and step % summary == 0:
            log.info(f"step {step}: " + self.summary())

    def summary(self) -> str:
        """The latest figures in one line."""
        if not self.last:
            return "memory: not measured yet"
        ranks = ", ".join(f"rank{i} RSS {r['rss_mib']:,.0f} MiB (peak {r['peak_rss_mib']:,.0f})"
                          for i, r in enumerate(self.last))
        return f"memory: {ranks} | available {min(r['available_mib'] for r in self.last) / 1024:,.1f} GiB"
