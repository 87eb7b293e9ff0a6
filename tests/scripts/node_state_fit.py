"""The fits of tests/test_node_state.py, one launch per group: python node_state_fit.py CONFIG.json OUT_DIR

CONFIG holds {"memory": [STATE, DIR]|null, "composition": [CONFIG.json, DIR]|null, "runs": [{...}, ...]}, all with
the same number of processes; every rank runs them in this order, in the same processes (Lightning's launcher
re-executes this script for the other local ranks; later fits reuse the processes and the process group):

* ``memory``: tests/scripts/node_state_memory.py's fit (4 ranks), first, while the processes are fresh: what it
  measures is the growth from before its model exists;
* ``composition``: the runs of a tests/scripts/composition_fit.py config, written to its DIR as that script writes
  them (an unexpected error there ends the launch);
* ``runs``: the checks against Lightning's "ddp", written to OUT_DIR. A run is

    {"name": ..., "world": 2|4, "strategy": "ddp" | {HorizonStrategy kwargs, e.g. "state", "ranks_per_node"},
     "precision": "64-true" | {HorizonPrecision kwargs}, "optimizer": "AdamW"|"Adagrad", "manual": bool,
     "clip": null|"trainer-norm"|"trainer-value"|"configure"|"configure-value"|"manual"|"manual-torch", "steps": N,
     "resume_from": PATH|null, "after_fit": bool}

``clip``: ``Trainer(gradient_clip_val=CLIP_NORM)`` (norm) or ``Trainer(gradient_clip_val=CLIP_VALUE,
gradient_clip_algorithm="value")``; ``configure``: ``self.clip_gradients(opt, CLIP_NORM, "norm")`` in
``configure_gradient_clipping`` (``configure-value``: ``self.clip_gradients(opt, CLIP_VALUE, "value")``);
``manual``: the same norm call in a manual training_step; ``manual-torch``:
``torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP_NORM)`` there. An epoch is ``steps`` steps.

Checkpoints: OUT_DIR/NAME/end.ckpt (ModelCheckpoint at the last step, during fit), OUT_DIR/NAME/after.ckpt
(``trainer.save_checkpoint`` after fit), and with ``after_fit`` OUT_DIR/NAME/after-eval.ckpt (saved again after
``trainer.validate``, ``test`` and ``predict``). Each rank writes OUT_DIR/NAME.rank{R}.pt: the final weights, this
rank's optimizer state, how many parameters held a gradient at the last step, the warnings raised, the evaluation
results, or the error. The strategy's 512-byte buckets can be overridden in ``strategy`` (``bucket_size_mb``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lightning_horizon import CommMonitor, HorizonPrecision, HorizonStrategy  # noqa: E402

BATCH = 4
CLIP_NORM, CLIP_VALUE = 0.05, 0.002  # both below what the gradients reach: every step clips


class Tiny(L.LightningModule):
    """Four Linear layers (8 parameters)."""

    def __init__(self, run: dict) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
                                 nn.Tanh(), nn.Linear(16, 3))
        self.run = run
        self.automatic_optimization = not run.get("manual")
        self.held = 0  # parameters holding a gradient at the last step, before clipping (node-sharded: the owned)

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return self.loss(batch)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.loss(batch))
        self.clip_in_manual(opt)
        opt.step()

    def clip_in_manual(self, opt) -> None:
        if self.run.get("clip") == "manual":
            self.clip_gradients(opt, gradient_clip_val=CLIP_NORM, gradient_clip_algorithm="norm")

    def on_before_optimizer_step(self, optimizer):
        self.held = sum(p.grad is not None for p in self.parameters())

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.run.get("clip") == "configure":
            self.clip_gradients(optimizer, gradient_clip_val=CLIP_NORM, gradient_clip_algorithm="norm")
        elif self.run.get("clip") == "configure-value":
            self.clip_gradients(optimizer, gradient_clip_val=CLIP_VALUE, gradient_clip_algorithm="value")
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return getattr(torch.optim, self.run["optimizer"])(self.parameters(), lr=0.05)


class TinyTorchClip(Tiny):
    """Manual optimization that clips with torch directly: on a node-sharded rank that is its own share's norm."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.loss(batch))
        torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP_NORM)
        opt.step()


def loader(world: int, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(world * steps * BATCH, 6, generator=g)
    y = torch.sin(x @ torch.randn(6, 3, generator=g))
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def strategy_of(run: dict):
    if run["strategy"] == "ddp":  # Lightning's own
        return DDPStrategy(timeout=timedelta(seconds=45))
    # 512-byte buckets: several per rank, in float64 and in bf16 alike
    return HorizonStrategy(**{"threads_per_rank": 1, "timeout": 45, "bucket_size_mb": 0.0005, **run["strategy"]})


def precision_args(run: dict) -> dict:
    p = run["precision"]
    return {"precision": p} if isinstance(p, str) else {"plugins": [HorizonPrecision(**p)]}


def fit(run: dict, out: Path) -> dict:
    if run.get("resume_from") and not Path(run["resume_from"]).exists():
        raise FileNotFoundError(f"{run['resume_from']} was not written (the fit that writes it failed)")
    L.seed_everything(7, verbose=False)
    model = (TinyTorchClip if run.get("clip") == "manual-torch" else Tiny)(run)
    clip = run.get("clip")
    clip_args = ({"gradient_clip_val": CLIP_NORM} if clip == "trainer-norm" else
                 {"gradient_clip_val": CLIP_VALUE, "gradient_clip_algorithm": "value"} if clip == "trainer-value"
                 else {})
    folder = out / run["name"]
    steps = run["steps"]
    comm = CommMonitor(log_every_n_steps=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=run["world"], strategy=strategy_of(run), max_steps=steps, max_epochs=-1,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=folder, filename="end", every_n_train_steps=steps, save_top_k=-1), comm],
        default_root_dir=str(out / "root"), **clip_args, **precision_args(run),
    )
    data = loader(run["world"], run.get("epoch_steps", steps))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data, ckpt_path=run.get("resume_from"))
        trainer.save_checkpoint(folder / "after.ckpt")
        evaluated = {}
        if run.get("after_fit"):
            evaluated["validate"] = trainer.validate(model, data, verbose=False)
            evaluated["test"] = trainer.test(model, data, verbose=False)
            evaluated["predict"] = len(trainer.predict(model, data))
            trainer.save_checkpoint(folder / "after-eval.ckpt")
    return {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "final": {n: p.detach().clone() for n, p in model.named_parameters()},
        "opt_state": trainer.optimizers[0].state_dict()["state"],
        "held": model.held,
        "warnings": [str(w.message) for w in caught],
        "evaluated": evaluated,
        "comm": comm.last,  # the monitor's figures of the last step
        "error": None,
    }


def main(config: str, out_dir: str) -> None:
    out = Path(out_dir)
    cfg = json.loads(Path(config).read_text())
    # imported here, not at the top: the memory fit's processes hold what its own script would, no more
    if cfg.get("memory"):
        from tests.scripts.node_state_memory import main as measure_memory

        measure_memory(*cfg["memory"])
    if cfg.get("composition"):
        from tests.scripts.composition_fit import main as composition

        composition(*cfg["composition"])
    rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    for run in cfg["runs"]:
        try:
            result = fit(run, out)
        except Exception as err:  # recorded for the test; every rank fails alike at setup (or times out at 45 s)
            result = {"rank": rank, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            print(f"RUN {run['name']} rank {rank} FAILED: {result['error']}", flush=True)
        torch.save(result, out / f"{run['name']}.rank{result['rank']}.pt")
        if result["rank"] == 0 and result["error"] is None:
            print(f"RUN {run['name']} ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
