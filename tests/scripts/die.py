"""A fit in which one rank dies mid-step: python die.py DEVICES VICTIM HOW TIMEOUT_S (under Lightning's launcher),
or ``fit(DEVICES, VICTIM, HOW, TIMEOUT_S)`` in each rank of a world forked after the imports (tests/launch.py's
``run_worlds``).

HOW is "exit" (os._exit) or "kill" (SIGKILL to itself). The surviving ranks must fail, name the lost rank and
exit; the launching test checks the time this takes and that no process is left.
"""

import os
import signal
import sys

import lightning as L
import torch

from lightning_horizon import HorizonStrategy
from tests.scripts.fit import TinyLM, data


class Die(L.Callback):
    def __init__(self, victim: int, how: str) -> None:
        self.victim, self.how = victim, how

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 3 and trainer.global_rank == self.victim:
            print(f"rank {self.victim} dies now ({self.how})", flush=True)
            if self.how == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)


def fit(devices: int, victim: int, how: str, timeout_s: float) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=HorizonStrategy(timeout=timeout_s),
                        max_steps=50, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Die(victim, how)])
    trainer.fit(TinyLM(), torch.utils.data.DataLoader(data(n=4096), batch_size=8))
    print("FINISHED", flush=True)  # must never be reached


if __name__ == "__main__":
    fit(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
