"""Fit with a DataLoader subclass whose ``__init__`` takes the sampler positionally, and write each outcome.

usage: python dropin_loader.py OUT.json STRATEGY[,STRATEGY...] SOURCE[,SOURCE...]

SOURCE is LOADER-WHERE: LOADER ``positional`` or ``kwargs`` (the classes below), WHERE ``hook`` (the loader
comes from ``train_dataloader``, where Lightning records its constructor arguments) or ``fit`` (it is passed to
``trainer.fit``). Every (strategy, source) pair runs in turn with devices=2 on the CPU; local rank 0 writes
``{"strategy/source": outcome}`` (see :func:`outcome`). The strategies of one launch must share a launcher kind:
the popen launcher re-executes this script for rank 1, which then runs the same fits in the same order.
"""

import json
import os
import sys
import traceback

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

import lightning_horizon  # noqa: F401  (registers "horizon", "horizon_spawn")


class PositionalSamplerLoader(DataLoader):
    """A user's loader: the sampler is a required positional argument of its own ``__init__``."""

    def __init__(self, dataset, sampler, batch_size=2):
        super().__init__(dataset, batch_size=batch_size, sampler=sampler)


class KwargsLoader(DataLoader):
    """The same with ``**kwargs`` passed on, so that Lightning can inject its own sampler arguments."""

    def __init__(self, dataset, sampler, batch_size=2, **kwargs):
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)


LOADERS = {"positional": PositionalSamplerLoader, "kwargs": KwargsLoader}


def _dataset():
    return TensorDataset(torch.arange(16.0).unsqueeze(1))


def _loader(kind):
    dataset = _dataset()
    return LOADERS[kind](dataset, SequentialSampler(dataset))


class Model(L.LightningModule):
    def __init__(self, kind, from_hook):
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.kind, self.from_hook = kind, from_hook

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return _loader(self.kind) if self.from_hook else None


_CAUSE = "The above exception was the direct cause of the following exception:"


def outcome(error):
    """``"ok"``, or the error's last line as a traceback prints it, after its causes': ``"TypeError: ... <-
    lightning....MisconfigurationException: ..."``. An error a spawned rank raised comes back as a
    ProcessRaisedException that holds the rank's traceback as text: the same lines are read from it."""
    if error is None:
        return "ok"
    if type(error).__name__ == "ProcessRaisedException":
        return " <- ".join(block.strip().splitlines()[-1] for block in str(error).split(_CAUSE))
    chain = []
    while error is not None:
        chain.insert(0, "".join(traceback.format_exception_only(error)).strip().splitlines()[-1])
        error = error.__cause__
    return " <- ".join(chain)


def run(strategies, sources):
    """``{"strategy/source": outcome}`` of a 2-step fit per pair, with devices=2 on the CPU."""
    results = {}
    for strategy in strategies:
        for source in sources:
            kind, where = source.split("-")
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
            error = None
            try:
                trainer.fit(Model(kind, from_hook=where == "hook"), _loader(kind) if where == "fit" else None)
            except Exception as e:  # noqa: BLE001  the outcome is the result
                error = e
            results[f"{strategy}/{source}"] = outcome(error)
    return results


if __name__ == "__main__":
    out = run(sys.argv[2].split(","), sys.argv[3].split(","))
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
