"""A fit in which one rank hangs mid-fit: ``fit(DEVICES, VICTIM, HOW, HEARTBEAT_S, CKPT_DIR)`` in each rank of a world
forked after the imports (tests/launch.py's ``run_worlds``).

HOW is "stop" (the victim stops itself with SIGSTOP at step 3: its process, heartbeat thread included, no longer
runs) or "sleep" (it sleeps an hour inside ``training_step`` of step 3: its heartbeat thread runs on, its training
does not). A checkpoint is written after every step. The heartbeat must name the victim on the other ranks, end
the job with a non-zero status within the heartbeat timeout and a margin, leave no process running, and leave the
last complete checkpoint on disk. The collective timeout is an hour: only the heartbeat can end the job.
"""

import os
import signal
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_horizon import HorizonStrategy
from tests.scripts.fit import TinyLM, data

HANG_STEP = 3


class Hang(L.Callback):
    def __init__(self, victim: int, how: str) -> None:
        self.victim, self.how = victim, how

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == HANG_STEP and trainer.global_rank == self.victim and self.how == "stop":
            print(f"rank {self.victim} hangs now ({self.how}) at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)


class SleepyLM(TinyLM):
    def __init__(self, victim: int, how: str) -> None:
        super().__init__()
        self.victim, self.how = victim, how

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == HANG_STEP and self.global_rank == self.victim and self.how == "sleep":
            print(f"rank {self.victim} hangs now ({self.how}) at {time.time():.3f}", flush=True)
            time.sleep(3600)
        return super().training_step(batch, batch_idx)


def fit(devices: int, victim: int, how: str, heartbeat_s: float, ckpt_dir: str) -> None:
    every_step = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=50, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Hang(victim, how), every_step],
                        strategy=HorizonStrategy(timeout=3600, heartbeat_timeout=heartbeat_s))
    trainer.fit(SleepyLM(victim, how), torch.utils.data.DataLoader(data(n=4096), batch_size=8))
    print("FINISHED", flush=True)  # must never be reached
