"""Preemption: a SIGTERM (SLURM, Kubernetes, torchrun's agent) checkpoints at the next step boundary, then the job ends.

Lightning already catches SIGTERM (its signal connector sets ``trainer.received_sigterm``; the training loop
broadcasts rank 0's flag before each batch and raises ``SIGTERMException`` on every rank). Two gaps remain, and this
callback fills them on top of Lightning's machinery rather than beside it:

- nothing is saved: the steps since the last checkpoint are lost;
- the flag is rank 0's, and Lightning's handler issues a ``broadcast`` from inside the signal handler, where each
  rank runs it at another point of its program (a SIGTERM that reaches every rank pairs one rank's handler broadcast
  with another's gradient allreduce).

While training, the handler only records the signal (and, under Lightning's own launcher, forwards it to the
children as Lightning's does). After every training step each rank contributes its flag to one small ``MAX``
allreduce, so every rank agrees on the same step, even where the signal reached one node only. At that step every
rank writes the ``last`` checkpoint of the trainer's ModelCheckpoint (the one ``ckpt_path="last"`` resumes from),
waits for any background write to be on disk, and sets ``trainer.received_sigterm``: Lightning's loop then ends the
fit on every rank after this very step. A restart with ``ckpt_path="last"`` starts at the next step: nothing is lost
and nothing is repeated.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose
from typing_extensions import override

log = logging.getLogger("lightning_horizon.strategy")


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM: every rank agrees on a step, the ``last`` checkpoint is written there, the fit ends (module doc).

    Needs a ``ModelCheckpoint`` with ``save_last=True`` (the checkpoint lands at its ``last`` path); without one it
    writes ``last.ckpt`` under ``default_root_dir/checkpoints``.
    """

    def __init__(self) -> None:
        self._signalled = False
        self._previous: Any = None
        #: the global step at which the last fit stopped for a SIGTERM (``None``: it did not)
        self.stopped_at: Optional[int] = None
        #: the checkpoint written then
        self.path: Optional[str] = None

    @override
    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._signalled, self.stopped_at, self.path = False, None, None
        connector = trainer._signal_connector
        current = signal.getsignal(signal.SIGTERM)
        handlers = current.signal_handlers if isinstance(current, _HandlersCompose) else [current]
        # Lightning's notifier, minus its collective: recorded here, agreed on at the step's end
        kept = [h for h in handlers if getattr(h, "__func__", None) is not type(connector)._sigterm_notifier_fn]
        kept = [h for h in kept if callable(h) and h not in (signal.SIG_DFL, signal.SIG_IGN)]
        self._previous = current
        try:
            signal.signal(signal.SIGTERM, _HandlersCompose([self._record(trainer), *kept]))
        except ValueError:  # not the main thread: Lightning's own handling stays
            self._previous = None

    def _record(self, trainer: "L.Trainer") -> Any:
        def record(signum: int, frame: Any) -> None:
            if not self._signalled:
                log.info(f"HorizonStrategy, rank {trainer.global_rank}: SIGTERM received; checkpointing at the end"
                         " of this step")
                launcher = trainer.strategy.launcher
                if launcher is not None:  # Lightning's launcher: its children get it too, as Lightning does
                    launcher.kill(signum)
            self._signalled = True

        return record

    def _agreed(self, trainer: "L.Trainer") -> bool:
        flag = torch.tensor([1 if self._signalled else 0], dtype=torch.int32)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @override
    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.fit_loop.epoch_loop._should_accumulate() or not self._agreed(trainer):
            return
        path = self.last_path(trainer)
        trainer.save_checkpoint(path)  # every rank: HorizonStrategy gathers the parts' state to rank 0
        wait = getattr(trainer.strategy.checkpoint_io, "wait", None)
        if callable(wait):
            wait()  # on disk before the process ends
        self.stopped_at, self.path = trainer.global_step, path
        trainer.strategy.barrier("preemption checkpoint")
        log.warning(f"HorizonStrategy, rank {trainer.global_rank}: stopped for SIGTERM after step"
                    f" {trainer.global_step}; checkpoint {path}; resume with ckpt_path='last'")
        trainer._signal_connector.received_sigterm = True  # Lightning ends the fit after this step, on every rank

    @staticmethod
    def last_path(trainer: "L.Trainer") -> str:
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath is not None:
                return os.path.join(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
        return os.path.join(trainer.default_root_dir, "checkpoints", "last.ckpt")

    @override
    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._restore()

    @override
    def on_exception(self, trainer: "L.Trainer", pl_module: "L.LightningModule", exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._previous is not None:
            try:
                signal.signal(signal.SIGTERM, self._previous)
            except ValueError:
                pass
            self._previous = None


__all__ = ["PreemptionCheckpoint"]
