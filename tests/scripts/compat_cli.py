"""LightningCLI with a strategy by name, from the real command line (issue 17's drop-in suite).

usage: COMPAT_CLI_OUT=DIR python compat_cli.py fit --config CFG --trainer.strategy NAME --trainer.devices 2 ...
(:func:`arguments` builds the rest of the command line)

Lightning's launcher re-executes this command line for the other local ranks; each rank writes
DIR/rank{R}.json with what the fit left (weights, metrics, the strategy in the saved config.yaml).
tests/scripts/compat_suite.py builds the same CLI in-process (``args=``) through :func:`run`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.strategies import DDPStrategy

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import lightning_horizon  # noqa: E402,F401  (registers "horizon")


class CLIBoring(BoringModel):
    """BoringModel logging its losses (val synced), as a CLI user's model would."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"])
        return out

    def validation_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("val_loss", loss, sync_dist=True)
        return {"x": loss}


def outcome(cli: LightningCLI) -> dict[str, Any]:
    trainer = cli.trainer
    params = [p.detach().double() for p in cli.model.parameters()]
    out: dict[str, Any] = {
        "global_step": trainer.global_step, "epoch": trainer.current_epoch, "world": trainer.world_size,
        "is_ddp": isinstance(trainer.strategy, DDPStrategy), "status": str(trainer.state.status),
        "weights": {"sum": float(sum(p.sum() for p in params)), "sq": float(sum((p * p).sum() for p in params))},
        "metrics": {k: float(v) for k, v in sorted(trainer.callback_metrics.items())},
    }
    saved = Path(trainer.log_dir or trainer.default_root_dir) / "config.yaml"
    if trainer.global_rank == 0:  # SaveConfigCallback writes on rank 0
        import yaml

        strategy = yaml.safe_load(saved.read_text())["trainer"]["strategy"] if saved.exists() else None
        if isinstance(strategy, dict):  # a class path: its init args differ by class, the one we set must not
            strategy = {"class_path": "class_path" in strategy,
                        "process_group_backend": strategy["init_args"]["process_group_backend"]}
        out["saved_strategy"] = strategy
    return out


def arguments(devices: int, root: Path, *args: str) -> list[str]:
    """``fit``, ``args``, then what every CLI case shares: a short fit (3 batches, then 2 validation batches)."""
    return ["fit", *args, "--trainer.accelerator=cpu", f"--trainer.devices={devices}", "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={root}", "--seed_everything=42"]


def write_config(path: Path, strategy: str) -> Path:
    """A config file that names the strategy (``trainer: strategy: NAME``)."""
    path.write_text(f"trainer:\n  strategy: {strategy}\n")
    return path


def run(args: Optional[list[str]] = None) -> dict[str, Any]:
    """Build and run the CLI (``args=None``: from sys.argv) and return what the fit left."""
    cli = LightningCLI(CLIBoring, BoringDataModule, args=args, save_config_kwargs={"overwrite": True})
    return outcome(cli)


if __name__ == "__main__":
    result = run()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    out_dir = Path(os.environ["COMPAT_CLI_OUT"])
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # rank 0 leaves only when every rank has written
