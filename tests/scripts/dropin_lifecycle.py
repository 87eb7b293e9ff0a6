"""Two-rank fits for the drop-in tests: the thread settings rank 0 finds after fit, or the error a module with an
unused parameter gets.

usage: python dropin_lifecycle.py threads OUT.json
       python dropin_lifecycle.py unused OUT.json '{"collectives": ..., ...}'   (HorizonStrategy kwargs)
Run as a script, Lightning's launcher re-runs it for rank 1; tests/test_ddp_dropin.py calls ``main(...)`` in each rank
of a world forked from its launch instead. Rank 0 writes OUT.json.
"""

import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_horizon import HorizonStrategy


class UnusedParameter(BoringModel):
    """Lightning's BoringModel with a layer that never takes part in the loss."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(32, 2)


def settings():
    return {"env": {v: os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "KMP_AFFINITY", "KMP_BLOCKTIME")},
            "affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}


class Record(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.during = settings()


def main(mode, out, kwargs="{}"):
    torch.set_num_threads(2)
    record = Record()
    before = settings()  # the Trainer's construction sets OMP_NUM_THREADS for Lightning's launcher; fit's end unsets it
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HorizonStrategy(**json.loads(kwargs)), max_steps=3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[record])
    result = {}
    try:
        trainer.fit(UnusedParameter() if mode == "unused" else BoringModel())
        result["after"], result["before"], result["during"] = settings(), before, record.during
    except RuntimeError as e:
        result["error"] = str(e)
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
