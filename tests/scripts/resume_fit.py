"""Mid-epoch interruptions and resumes, at the same and at other world sizes: ``fit_all(RUNS.json, OUT_DIR)`` in
every rank of a world (tests/scripts/forked_worlds.py's ``run_jobs`` forks the worlds; tests/test_resume.py).

A run is ``{"name": ..., "devices": N, "ranks_per_node": R, "batch": per-rank batch size, "samples": S,
"max_steps": M, "max_epochs": E (with "onecycle": OneCycleLR over trainer.estimated_stepping_batches, which builds
the training loader inside configure_optimizers), "loader": "plain" | "dict" (two loaders of different lengths,
Lightning's CombinedLoader, max_size_cycle) | "torchdata" | "torchdata_iterable", "workers": num_workers,
"shuffle": bool, "use_distributed_sampler": bool, "dropout": p, "precision": Trainer precision, "ckpt_dir": DIR, "resume_from": DIR or null,
"stop_at": step or null}``. ``stop_at`` ends the fit on every rank in the forward of that optimizer step (0-based),
after the checkpoint of the steps before it was written (checkpoints after every step): the job is interrupted
mid-epoch where it stands.

The dataset returns each sample's index with its features, and every rank records, per step, the indices it trained
on: OUT_DIR/NAME.rank{R}.json (per step: the global step, the indices, a hash of the weights; also the crashed run's
steps) and OUT_DIR/NAME.rank{R}.pt (the final parameters; not for a stopped run).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_horizon import HorizonStrategy

FEATURES, CLASSES = 12, 5


class Stop(Exception):
    """The job is interrupted: every rank raises it in the same step."""


class Indexed(Dataset):
    """Random features with a linear teacher's class, and the sample's own index."""

    def __init__(self, samples: int, offset: int = 0) -> None:
        g = torch.Generator().manual_seed(3 + offset)
        self.x = torch.randn(samples, FEATURES, generator=g, dtype=torch.float64)
        self.y = (self.x @ torch.randn(FEATURES, CLASSES, generator=g, dtype=torch.float64)).argmax(1)
        self.offset = offset

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return torch.tensor(i + self.offset), self.x[i], self.y[i]


class StatefulStream(IterableDataset):
    """An IterableDataset that keeps its own position (torchdata's protocol: ``state_dict`` on the dataset); each
    rank reads every world-size-th sample of a fixed order."""

    def __init__(self, data: Indexed, rank: int, world: int) -> None:
        self.data, self.rank, self.world, self.next = data, rank, world, 0
        self.order = torch.randperm(len(data), generator=torch.Generator().manual_seed(7)).tolist()

    def __iter__(self):
        mine = self.order[self.rank::self.world]
        while self.next < len(mine):
            i = mine[self.next]
            self.next += 1
            yield self.data[i]
        self.next = 0

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


class Model(L.LightningModule):
    def __init__(self, run: dict) -> None:
        super().__init__()
        self.run = run
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Dropout(run.get("dropout", 0.0)),
                                 nn.Linear(16, CLASSES))
        self.rows: list[dict] = []

    def training_step(self, batch, batch_idx):
        if self.run.get("stop_at") is not None and self.global_step == self.run["stop_at"]:
            raise Stop(f"rank {self.global_rank} stopped in step {self.global_step}")
        parts = batch.values() if isinstance(batch, dict) else [batch]
        loss = sum(nn.functional.cross_entropy(self.net(x.to(self.dtype)), y) for _, x, y in parts)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        parts = [batch[k] for k in sorted(batch)] if isinstance(batch, dict) else [batch]
        self.rows.append({"step": self.global_step - 1, "epoch": self.current_epoch, "batch_idx": batch_idx,
                          "indices": [p[0].tolist() for p in parts], "weights": weights_hash(self)})

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.01)
        if self.run.get("onecycle"):
            total = self.trainer.estimated_stepping_batches  # builds the training loader here, before any restore
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=int(total))
        else:
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def weights_hash(module: nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def loaders(run: dict, rank: int):
    data, batch, workers = Indexed(run["samples"]), run["batch"], run.get("workers", 0)
    shuffle = run.get("shuffle", True)
    kind = run.get("loader", "plain")
    if kind == "plain":
        return DataLoader(data, batch_size=batch, shuffle=shuffle, num_workers=workers)
    if kind == "dict":  # a second, shorter loader cycles within the epoch (max_size_cycle)
        short = Indexed(run["samples"] // 3, offset=10_000)
        return {"a": DataLoader(data, batch_size=batch, shuffle=shuffle, num_workers=workers),
                "b": DataLoader(short, batch_size=batch, shuffle=shuffle)}
    from torchdata.stateful_dataloader import StatefulDataLoader
    if kind == "torchdata":
        return StatefulDataLoader(data, batch_size=batch, shuffle=shuffle, num_workers=workers)
    return StatefulDataLoader(StatefulStream(data, rank, run["devices"]), batch_size=batch, num_workers=workers)


def fit(run: dict, out: Path) -> None:
    L.seed_everything(11, verbose=False)
    torch.set_default_dtype(torch.float64 if run.get("precision") == "64-true" else torch.float32)
    model = Model(run)
    strategy = ("ddp" if run.get("lightning_ddp") else  # plain Lightning, resuming a checkpoint of HorizonStrategy's
                HorizonStrategy(ranks_per_node=run["ranks_per_node"], threads_per_rank=1, timeout=60,
                                **run.get("strategy", {})))
    ckpt = ModelCheckpoint(dirpath=run["ckpt_dir"], save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=run["devices"], strategy=strategy, precision=run.get("precision", "32-true"),
        use_distributed_sampler=run.get("use_distributed_sampler", True),
        callbacks=[ckpt], max_steps=run.get("max_steps", -1), max_epochs=run.get("max_epochs", -1), logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=run["ckpt_dir"],
    )
    rank = trainer.global_rank
    resume = str(Path(run["resume_from"]) / "last.ckpt") if run.get("resume_from") else None
    stopped = False
    try:
        trainer.fit(model, loaders(run, rank), ckpt_path=resume)
    except Stop:
        stopped = True
    info = {"rank": rank, "world": trainer.world_size, "global_step": trainer.global_step, "rows": model.rows,
            "stopped": stopped}
    (out / f"{run['name']}.rank{rank}.json").write_text(json.dumps(info))
    if not stopped:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out / f"{run['name']}.rank{rank}.pt")
    torch.set_default_dtype(torch.float32)


def fit_all(config: str, out_dir: str) -> None:
    for run in json.loads(Path(config).read_text()):
        fit(run, Path(out_dir))


if __name__ == "__main__":
    fit_all(sys.argv[1], sys.argv[2])
