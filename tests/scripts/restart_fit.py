"""Crash and exact restart with every part on: python restart_fit.py CONFIG.json OUT_DIR

CONFIG holds {"worlds": [{"tag": ..., "devices": N, "runs": [{...}, ...]}, ...]}. The worlds run one after another,
each a set of N fresh rank processes that run its runs in order (later fits reuse the processes and the process
group). This process forks every world's ranks from itself after its imports (tests/scripts/forked_worlds.py): the
imports are paid once, not once per rank and world. A world's ranks write their output to OUT_DIR/TAG.log; when they
have all ended, this process appends ``{"tag": TAG, "exit": [exit status per rank]}`` (-9: SIGKILL) to
OUT_DIR/exits.jsonl and prints the log. A run is

    {"name": ..., "devices": 2|4, "ranks_per_node": 1|2, "strategy": {HorizonStrategy kwargs},
     "precision": {HorizonPrecision kwargs}, "max_steps": N, "samples": S, "ckpt_dir": DIR, "resume": bool,
     "kill": [rank, step] or null, "nonfinite": {"<dataset index>": "nan"|"inf"},
     "poison": [[rank, step, "nan"|"inf"], ...], "squeeze_at": step}

``squeeze_at`` cuts each rank's sharding budget after that step below what any plan reaches, so that the plan with
the smallest peak is installed and the later steps recompute activations (``sharding="auto"`` on a roomy machine
recomputes nothing). ``nonfinite`` puts NaN or Inf into samples of the dataset, ``poison`` into one rank's batch
at one step (for epochs of one step, where a bad sample would spoil every step). ``kill`` SIGKILLs that rank in
the forward of optimizer step ``step`` (0-based), after the checkpoint of the ``step`` steps before it was
written; the other ranks then fail in their next collective. Checkpoints are written after every step; a kill in the
middle of an epoch resumes at the epoch's next batch (HorizonStrategy keeps the data position:
lightning_horizon/data_position.py).

Each run writes, per rank, OUT_DIR/NAME.rank{R}.json (per step: the batch's index in its epoch, a hash of the
weights and whether the rank's batch held NaN/Inf; the backoff counters; how many DDP buckets the collectives cut into the checkpoint's layout;
how many calls the final sharding plan recomputes) and OUT_DIR/NAME.rank{R}.pt (the final parameters, compared
bit for bit by the test).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_horizon import GradNormBackoff, HorizonPrecision, HorizonStrategy

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.scripts import forked_worlds  # noqa: E402

FEATURES, HIDDEN, CLASSES, BATCH = 24, 72, 10, 8


class Features(Dataset):
    """Random features and a fixed linear teacher's class; the listed samples get a NaN or an Inf feature."""

    def __init__(self, samples: int, nonfinite: dict[int, str]) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(samples, FEATURES, generator=g)
        self.y = (self.x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)
        for i, kind in nonfinite.items():
            self.x[i, 3] = float("nan") if kind == "nan" else float("inf")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Classifier(L.LightningModule):
    """Three Linear layers with dropout: several DDP buckets, and random draws in every step."""

    def __init__(self, kill, poison) -> None:
        super().__init__()
        self.kill = kill
        self.poison = {(rank, step): float(kind) for rank, step, kind in poison}
        self.net = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Dropout(0.2),
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Dropout(0.2),
            nn.Linear(HIDDEN, CLASSES),
        )
        self.rows: list[dict] = []

    def training_step(self, batch, batch_idx):
        if self.kill is not None and self.global_rank == self.kill[0] and self.global_step == self.kill[1]:
            print(f"rank {self.global_rank} killed in step {self.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        bad = self.poison.get((self.global_rank, self.global_step))
        if bad is not None and torch.is_grad_enabled():
            x[0, 3] = bad  # in the batch itself, so on_train_batch_end sees it too
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):  # not in training_step: the sharding profile reruns it
        x = batch[0]
        kind = "nan" if torch.isnan(x).any() else "inf" if torch.isinf(x).any() else None
        self.rows.append({"step": self.global_step, "batch": batch_idx, "nonfinite": kind,
                          "weights": weights_hash(self)})

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Squeeze(L.Callback):
    """Cut the sharding budget after ``step`` below any plan: the next boundary installs the smallest peak."""

    def __init__(self, step) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sharder = trainer.strategy.sharder
        if trainer.global_step == self.step and sharder is not None:
            sharder.set_budget(sharder.plan.floor // 2, "test squeeze")


def weights_hash(module: nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()[:16]


def fit(run: dict, out: Path) -> None:
    L.seed_everything(11, verbose=False)
    model = Classifier(run.get("kill"), run.get("poison", []))
    strategy = HorizonStrategy(ranks_per_node=run["ranks_per_node"], threads_per_rank=1, timeout=60,
                               **run["strategy"])
    backoff = GradNormBackoff(max_norm=1.0, spike_threshold=1e3, recover_after=3)
    ckpt = ModelCheckpoint(dirpath=run["ckpt_dir"], save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=run["devices"], strategy=strategy,
        plugins=[HorizonPrecision(**run["precision"])], callbacks=[backoff, ckpt, Squeeze(run.get("squeeze_at"))],
        max_steps=run["max_steps"], max_epochs=-1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=run["ckpt_dir"],
    )
    nonfinite = {int(k): v for k, v in run.get("nonfinite", {}).items()}
    loader = DataLoader(Features(run["samples"], nonfinite), batch_size=BATCH, shuffle=True)
    trainer.fit(model, loader, ckpt_path="last" if run.get("resume") else None)
    rank = trainer.global_rank
    sync = strategy.gradient_sync
    info = {
        "rank": rank, "world": trainer.world_size, "global_step": trainer.global_step, "rows": model.rows,
        "skipped": backoff.skipped_steps, "cuts": sync.layout.cuts if sync is not None else None,
        "recompute": None if strategy.sharder is None else len(strategy.sharder.plan.recompute),
    }
    (out / f"{run['name']}.rank{rank}.json").write_text(json.dumps(info))
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out / f"{run['name']}.rank{rank}.pt")


def fit_all(runs: list[dict], out: Path) -> None:
    for run in runs:
        fit(run, out)


def main(config: str, out_dir: str) -> None:
    out = Path(out_dir)
    for world in json.loads(Path(config).read_text())["worlds"]:
        log = out / f"{world['tag']}.log"
        exits = forked_worlds.world(world["devices"], functools.partial(fit_all, world["runs"], out), log)
        forked_worlds.record(out, world["tag"], exits, log)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
