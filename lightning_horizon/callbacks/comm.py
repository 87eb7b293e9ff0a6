"""CommMonitor: bytes sent and time spent in gradient communication per step, from the strategy's own accounting.

The monitor measures nothing itself: every gradient path of HorizonStrategy (DDP's comm hooks and the periodic
cross-node sync in lightning_horizon.collectives, node-sharded state's owners, the sharded embedding tables'
exchanges) counts what each step sent per link class and how long it waited, and ``strategy.comm_metrics()`` sums
them. The monitor logs those figures, with the share of the step's wall time spent communicating. Where nothing is
counted it logs nothing: silently on one process (nothing is sent), with one line on several (a strategy without
such accounting, e.g. Lightning's own DDP, or a DDP comm hook of your own, whose traffic only you know).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_horizon.callbacks.interval import check_interval

log = logging.getLogger(__name__)

_MIB = 2**20


def find_comm_metrics(strategy: Any) -> Optional[Callable[[], dict[str, float]]]:
    """The strategy's per-step communication figures as a ``metrics()`` callable (``strategy.comm_metrics``), or
    None where it keeps none."""
    direct = getattr(strategy, "comm_metrics", None)
    return direct if callable(direct) else None


class CommMonitor(Callback):
    """Log the strategy's communication accounting (``comm/...``) every ``log_every_n_steps``; summarize every N.

    Logged (rank 0's figures for the step that just ended, as the strategy names them), e.g.
    ``comm/intra_bytes``, ``comm/inter_bytes``, ``comm/seconds``, ``comm/calls``, plus ``comm/time_share``: the
    communication seconds over the step's wall time.

    Args:
        log_every_n_steps: log every this many optimizer steps; ``None``: the Trainer's ``log_every_n_steps``.
        summary_every_n_steps: print a one-line summary every this many steps (0: never); ``None``: every
            ``log_every_n_steps``.
    """

    def __init__(self, log_every_n_steps: Optional[int] = None, summary_every_n_steps: Optional[int] = None) -> None:
        check_interval("CommMonitor", "log_every_n_steps", log_every_n_steps, 1)
        check_interval("CommMonitor", "summary_every_n_steps", summary_every_n_steps, 0)
        self.log_every_n_steps, self.summary_every_n_steps = log_every_n_steps, summary_every_n_steps
        self.source: Optional[Callable[[], dict[str, float]]] = None
        #: the latest figures logged (empty while there is no source)
        self.last: dict[str, float] = {}
        self._announced = False
        self._t_last: Optional[float] = None
        self._last_step = -1

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # after strategy.setup: the gradient paths and their accounting exist from here on
        self.source = find_comm_metrics(trainer.strategy)
        if self.source is None:
            self._nothing_to_log(trainer, "exposes no communication accounting")
        self._t_last = time.perf_counter()

    def _nothing_to_log(self, trainer: "pl.Trainer", why: str) -> None:
        """Say once why nothing is logged; nothing on one process, which sends nothing."""
        if not self._announced and trainer.global_rank == 0 and trainer.world_size > 1:
            log.info(f"CommMonitor: {type(trainer.strategy).__name__} (world size {trainer.world_size}) {why};"
                     " nothing to log")
        self._announced = True

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._t_last = time.perf_counter()  # validation time is not step time

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now, step = time.perf_counter(), trainer.global_step
        if self.source is None or step == self._last_step:
            return  # no optimizer step in this batch (an accumulation micro-batch): nothing new was reduced
        step_seconds = now - (self._t_last or now)
        self._t_last, self._last_step = now, step
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if step % every:
            return
        metrics = {k: float(v) for k, v in self.source().items()}
        if not metrics:  # nothing of this fit is counted (a DDP comm hook of your own): it will stay so
            self.source = None
            self._nothing_to_log(trainer, "counts none of this fit's communication (a DDP comm hook of yours is"
                                 " not counted)")
            return
        if "comm/seconds" in metrics and step_seconds > 0:
            metrics["comm/time_share"] = metrics["comm/seconds"] / step_seconds
        self.last = metrics
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, rank_zero_only=True)
        summary = every if self.summary_every_n_steps is None else self.summary_every_n_steps
        if trainer.global_rank == 0 and summary and step % summary == 0:
            log.info(f"step {step}: " + self.summary())

    def summary(self) -> str:
        """The latest figures in one line."""
        m = self.last
        if not m:
            return "comm: no accounting" if self.source is None else "comm: nothing logged yet"
        parts = [f"comm: {m.get('comm/intra_bytes', 0) / _MIB:.2f} MiB intra-node",
                 f"{m.get('comm/inter_bytes', 0) / _MIB:.2f} MiB inter-node"]
        if "comm/embedding_bytes" in m:
            parts.append(f"{m['comm/embedding_bytes'] / _MIB:.2f} MiB embedding lookups")
        if "comm/seconds" in m:
            share = f" ({100 * m['comm/time_share']:.0f}% of the step)" if "comm/time_share" in m else ""
            parts.append(f"{1e3 * m['comm/seconds']:.1f} ms{share}")
        if "comm/calls" in m:
            parts.append(f"{m['comm/calls']:.0f} calls")
        return ", ".join(parts) + " per step"
