"""Drop-in checks against Lightning's ddp, several fits in one launch: who calls ``torch.save`` while checkpoints
are written, and how a DataLoader subclass that takes its sampler positionally is re-instantiated.

usage: python dropin_fit.py OUT_PREFIX   (tests/test_ddp_dropin.py calls ``main(OUT_PREFIX)`` in each rank of a world
forked from its launch)

Every rank runs the same fits in the same order (run as a script, Lightning's launcher re-executes it for rank 1) and
writes OUT_PREFIX.rank{R}.json: ``{"saves": {run: {"calls": [caller, ...], "sent": digest, "file": digests}},
"loaders": {"strategy/source": outcome}}`` (see dropin_loader.py). "sent" is the digest of the per-rank state this
rank gathered at its last checkpoint, "file" (rank 0) that of every rank's state in the last checkpoint file.
"""

import hashlib
import json
import os
import sys
import traceback

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_horizon import HorizonStrategy
from tests.scripts import dropin_loader
from tests.scripts.fit import TinyLM, data

SAVE_RUNS = {
    "ddp": lambda: "ddp",
    "horizon": lambda: "horizon",
    # two emulated nodes: error-feedback residuals (int8), and local SGD's per-node weights and optimizer state
    "horizon_int8": lambda: HorizonStrategy(ranks_per_node=1, collectives="hierarchical", compression="int8"),
    "horizon_local_sgd": lambda: HorizonStrategy(ranks_per_node=1, sync_every=2),
}
#: resumed from the step-2 checkpoint of the run named, to step 6 (the load path, and local SGD's node state)
RESUMED = {"ddp_resumed": "ddp", "horizon_local_sgd_resumed": "horizon_local_sgd"}
LOADER_STRATEGIES = ("ddp", "horizon")
LOADER_SOURCES = ("positional-hook", "positional-fit", "kwargs-hook", "kwargs-fit")


class SaveCounter(L.Callback):
    """Wraps ``torch.save`` on this rank from ``setup`` to ``teardown`` and records where each call came from."""

    def __init__(self):
        self.calls, self._save = [], None

    def setup(self, trainer, pl_module, stage):
        self._save = save = torch.save

        def counted(*args, **kwargs):
            self.calls.append(_caller())
            return save(*args, **kwargs)

        torch.save = counted

    def teardown(self, trainer, pl_module, stage):
        torch.save = self._save


def _caller():
    """The innermost frame outside torch, as ``file:line``."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if f"{os.sep}torch{os.sep}" not in frame.filename:
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "?"


def digest(obj):
    """Every tensor in ``obj`` (dtype, shape, stride, bytes) and every other leaf, by path."""
    if isinstance(obj, dict):
        return {str(k): digest(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [digest(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        raw = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return [str(obj.dtype), list(obj.shape), list(obj.stride()), hashlib.sha256(raw).hexdigest()]
    return repr(obj)


def save_run(name, root, resume_from=None):
    L.seed_everything(7, verbose=False)
    counter = SaveCounter()
    checkpoints = ModelCheckpoint(dirpath=os.path.join(root, name), every_n_train_steps=2, save_top_k=-1)
    strategy = SAVE_RUNS[resume_from or name]()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=6 if resume_from else 4,
                        logger=False, callbacks=[checkpoints, counter], enable_progress_bar=False,
                        enable_model_summary=False)
    result = {}
    if isinstance(trainer.strategy, HorizonStrategy):
        gather = trainer.strategy.checkpoints.gather_objects

        def recorded(obj):
            result["sent"] = digest(obj)
            return gather(obj)

        trainer.strategy.checkpoints.gather_objects = recorded
    ckpt_path = os.path.join(root, resume_from, "epoch=0-step=2.ckpt") if resume_from else None
    trainer.fit(TinyLM(), DataLoader(data(64), batch_size=8), ckpt_path=ckpt_path)
    result["calls"] = counter.calls
    if trainer.global_rank == 0 and "sent" in result:
        saved = torch.load(checkpoints.last_model_path or checkpoints.best_model_path, weights_only=True)
        result["file"] = digest(saved["HorizonStrategy"]["ranks"])
    return trainer.global_rank, result


def main(out_prefix):
    root = os.path.dirname(os.path.abspath(out_prefix))
    saves, rank = {}, 0
    for name in SAVE_RUNS:
        rank, saves[name] = save_run(name, root)
    for name, resume_from in RESUMED.items():
        rank, saves[name] = save_run(name, root, resume_from)
    loaders = dropin_loader.run(LOADER_STRATEGIES, LOADER_SOURCES)
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump({"saves": saves, "loaders": loaders}, f)


if __name__ == "__main__":
    main(sys.argv[1])
