"""What a new user does first, in one process: names the strategy every way Lightning allows, then trains.

usage: python new_user.py YAML_DIR

1. LightningCLI (``run=False``, Lightning's BoringModel) parses each way of naming the strategy, first before
   anything imported lightning_horizon (as in an unmodified script), then after ``import lightning_horizon``; one
   ``CHECK <form>: <strategy class> | error <message>`` line each.
2. Three short fits with Lightning's progress bar on, as a user would run them, whose printed lines the test reads
   (tqdm's bar, Lightning's default without ``rich``; with ``rich`` installed, as ``transformers`` brings it, the
   default is RichProgressBar, which shows the same metrics as ``tok/s: 22973`` and redraws from a thread of its
   own, so its last frame of one fit can land after the next fit's first line):
   a token model for 20 steps with the default Trainer and a default ThroughputMFUMonitor (then validate and
   test), an image model (no sequence axis) following ``log_every_n_steps=4``, and a sharded fit of a step that
   reads a value (the fake profile falls back to a real one).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def check(label: str, args: list[str]) -> None:
    try:
        cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=args, parser_kwargs={"exit_on_error": False},
                           trainer_defaults={"accelerator": "cpu", "devices": 1, "logger": False})
        given = cli.config.trainer.strategy  # the name, or the class path with its init_args
        threads = given.init_args.get("threads_per_rank") if hasattr(given, "init_args") else None
        found = f"{type(cli.trainer.strategy).__name__} threads_per_rank={threads}"
    except Exception as e:  # what the user would see: jsonargparse's or Lightning's message
        found = f"error {type(e).__name__}: {' '.join(str(e).split())[:300]}"
    print(f"CHECK {label}: {found}", flush=True)


def naming(yaml_dir: Path) -> None:
    assert "lightning_horizon" not in sys.modules
    check("name, no import", ["--trainer.strategy=horizon"])
    assert "lightning_horizon" not in sys.modules
    check("class_path key, no import", ["--trainer.strategy.class_path=lightning_horizon.HorizonStrategy"])
    import lightning_horizon  # noqa: F401  (the one import: registers the names)

    forms = {
        "name": ["--trainer.strategy=horizon"],
        "class path": ["--trainer.strategy=lightning_horizon.HorizonStrategy"],
        "class name": ["--trainer.strategy=HorizonStrategy"],
        "class path + option": ["--trainer.strategy=lightning_horizon.HorizonStrategy",
                                "--trainer.strategy.threads_per_rank=1"],
        "class name + option": ["--trainer.strategy=HorizonStrategy", "--trainer.strategy.threads_per_rank=1"],
        "name + option": ["--trainer.strategy=horizon", "--trainer.strategy.threads_per_rank=1"],
    }
    yamls = {
        "yaml name": "strategy: horizon",
        "yaml class path string": "strategy: lightning_horizon.HorizonStrategy",
        "yaml class_path": "strategy:\n    class_path: lightning_horizon.HorizonStrategy\n"
                           "    init_args:\n      threads_per_rank: 1",
    }
    for label, text in yamls.items():
        path = yaml_dir / f"{label.replace(' ', '_')}.yaml"
        path.write_text(f"trainer:\n  {text}\n")
        forms[label] = ["--config", str(path)]
    for label, args in forms.items():
        check(label, args)


class Tokens(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)

    def step(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.step(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.step(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Images(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Gate(nn.Module):
    def forward(self, h):
        return h * (int((h > 0).sum()) / h.numel())  # reads a value: a fake tensor has none


class ReadsAValue(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), Gate(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fits() -> None:
    from lightning_horizon import HorizonPrecision, HorizonStrategy, MemoryMonitor, ThroughputMFUMonitor

    from lightning.pytorch.callbacks import TQDMProgressBar

    quiet = {"logger": False, "enable_checkpointing": False, "enable_model_summary": False}
    g = torch.Generator().manual_seed(0)
    tokens = TensorDataset(torch.randint(0, 64, (160, 16), generator=g), torch.randint(0, 64, (160, 16), generator=g))
    print("FIT tokens", flush=True)  # the default Trainer: log_every_n_steps=50, more than the run's 20 steps
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="horizon", max_steps=20, plugins=[HorizonPrecision()],
                        callbacks=[ThroughputMFUMonitor(), TQDMProgressBar()], **quiet)
    model = Tokens()
    trainer.fit(model, DataLoader(tokens, batch_size=8), DataLoader(tokens, batch_size=40))
    trainer.validate(model, DataLoader(tokens, batch_size=40), verbose=False)
    trainer.test(model, DataLoader(tokens, batch_size=40), verbose=False)

    print("FIT images", flush=True)
    images = TensorDataset(torch.randn(64, 3, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="horizon", max_steps=8, log_every_n_steps=4,
                        plugins=[HorizonPrecision()], **quiet,
                        callbacks=[ThroughputMFUMonitor(window_size=3, peak_matmul_sizes=(256,)), MemoryMonitor(),
                                   TQDMProgressBar()])
    trainer.fit(Images(), DataLoader(images, batch_size=8))

    print("FIT sharded", flush=True)
    rows = TensorDataset(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HorizonStrategy(sharding="auto"), max_steps=3,
                        callbacks=[ThroughputMFUMonitor(window_size=2, peak_matmul_sizes=(256,)), TQDMProgressBar()],
                        **quiet)
    trainer.fit(ReadsAValue(), DataLoader(rows, batch_size=8))
    print("DONE", flush=True)


if __name__ == "__main__":
    naming(Path(sys.argv[1]))
    fits()
