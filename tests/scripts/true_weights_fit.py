"""Local SGD (sync_every=2) over 2 emulated nodes x 2 ranks, with each HorizonPrecision bf16-true master.

usage: python true_weights_fit.py OUT_PREFIX (under Lightning's launcher), or ``main(OUT_PREFIX)`` in each of 4 ranks
forked after the imports (tests/launch.py's ``run_worlds``, as tests/test_state.py runs it)

Every rank trains on its own data, so the nodes' weights drift apart between averages. After every optimizer
step each rank records its TRUE weights, read through the strategy's TrainingState (the fp32 master, or the bf16
weight + its Kahan compensation), and right before every average, and writes them to OUT_PREFIX.rank{R}.pt.
"""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_horizon import HorizonPrecision, HorizonStrategy
from tests.scripts.fit import TinyLM, data


class PerRankData(TinyLM):
    def train_dataloader(self):
        return DataLoader(data(seed=1000 + self.global_rank), batch_size=16)


class RecordTrueWeights(L.Callback):
    """The true weights after every step, and right before every parameter average (when the strategy's
    TrainingState.average is called: wrapped on the instance)."""

    def __init__(self):
        self.steps, self.before_average = [], []

    def on_train_start(self, trainer, pl_module):
        state = trainer.strategy.training_state
        average = state.average

        def recorded(params, allreduce_mean):
            self.before_average.append([state.read(p) for p in pl_module.parameters()])
            return average(params, allreduce_mean)

        state.average = recorded

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        state = trainer.strategy.training_state
        self.steps.append([state.read(p) for p in pl_module.parameters()])


def main(out_prefix):
    out = {}
    for master in ("fp32", "kahan"):
        L.seed_everything(7, verbose=False)
        model, record = PerRankData(), RecordTrueWeights()
        trainer = L.Trainer(
            accelerator="cpu", devices=4, strategy=HorizonStrategy(ranks_per_node=2, sync_every=2),
            plugins=[HorizonPrecision("bf16-true", master=master, compute="fp32")], max_steps=4, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
            use_distributed_sampler=False,
        )
        trainer.fit(model)
        out[master] = record.steps
        out[f"{master}_before_average"] = record.before_average
    torch.save(out, f"{out_prefix}.rank{trainer.global_rank}.pt")
    trainer.strategy.barrier()  # rank 0 must not exit (and the launcher reap the others) before all have saved


if __name__ == "__main__":
    main(sys.argv[1])
