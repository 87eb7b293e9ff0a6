"""The drop-in compatibility suite (issue 17): Lightning's own test models and features under one strategy.

usage: python compat_suite.py STRATEGY OUT_DIR [--devices N] [--only SCENARIO,...] [--resume-from CKPT]

STRATEGY is a registered name ("ddp" for Lightning's own, "horizon" for ours). Every scenario below runs in
order in this one job (N ranks on the CPU, default 2): every rank builds the same Trainers in the same order, and
later fits reuse the processes and the process group. Run as a script, Lightning's launcher re-executes it for the
other local ranks; tests/test_ddp_compat.py calls ``main(...)`` in each rank of a world forked from its launch. Each rank writes OUT_DIR/rank{R}.json: {scenario: outcome}, an outcome being the numbers
a user sees (weight sums, logged metrics, checkpoint names, predictions, the tuner's answers) or the error
("error: Type: first line"). tests/test_ddp_compat.py runs it once per strategy and compares the two.
--resume-from names the other strategy's last.ckpt (of its early_stop_checkpoint scenario, the same state as
this job's own): the resume_checkpoint scenario resumes from it instead of from this job's own.

Only cli_class_path names the strategy classes: elsewhere whatever "ddp" and "horizon" resolve to must behave alike.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.distributed as dist
import torchmetrics
from lightning.pytorch.callbacks import (
    BatchSizeFinder,
    EarlyStopping,
    EMAWeightAveraging,
    LearningRateFinder,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.demos.boring_classes import (
    BoringDataModule,
    BoringModel,
    DemoModel,
    ManualOptimBoringModel,
    RandomDataset,
)
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import lightning_horizon  # noqa: E402,F401  (registers "horizon")
from tests.scripts import compat_cli  # noqa: E402

SEED = 42


# ------------------------------------------------------------------ models (Lightning's, plus what they lack)


class LoggingBoring(compat_cli.CLIBoring):
    """BoringModel that logs its losses (BoringModel itself logs nothing): train per rank, val/test synced."""

    def test_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("test_loss", loss, sync_dist=True)
        return {"y": loss}


class SyncDistModel(BoringModel):
    """Logs values that differ per rank, with every reduction a user reaches for, a torchmetrics metric (it syncs
    itself), and Lightning's collectives."""

    def __init__(self):
        super().__init__()
        self.metric = torchmetrics.MeanMetric()
        self.metric_sum = torchmetrics.SumMetric()

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        r = float(self.global_rank + 1)
        value = torch.tensor(r * (batch_idx + 1))
        self.metric.update(value)
        self.metric_sum.update(out["loss"].detach())
        self.log("tm_mean", self.metric, on_step=False, on_epoch=True)
        self.log("tm_sum", self.metric_sum, on_step=False, on_epoch=True)
        self.log("mean_sync", value, sync_dist=True, on_step=True, on_epoch=True)
        self.log("sum_sync", value, sync_dist=True, reduce_fx="sum", on_step=False, on_epoch=True)
        self.log("max_sync", value, sync_dist=True, reduce_fx="max", on_step=False, on_epoch=True)
        self.log("min_sync", value, sync_dist=True, reduce_fx="min", on_step=False, on_epoch=True)
        self.log("local", value, on_step=False, on_epoch=True)  # not synced: each rank's own
        self.log_dict({"dict_a": value * 2, "dict_b": out["loss"]}, sync_dist=True, on_step=False, on_epoch=True)
        self.log("loss_synced", out["loss"], sync_dist=True, prog_bar=True)
        return out

    def validation_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_rank", torch.tensor(float(self.global_rank)), sync_dist=True, reduce_fx="max")
        return {"x": loss}

    def on_train_epoch_end(self):
        r = torch.tensor([float(self.global_rank + 1), 10.0 * (self.global_rank + 1)])
        self.gathered = self.all_gather(r).tolist()
        self.reduced = float(self.trainer.strategy.reduce(r.sum(), reduce_op="sum"))
        self.reduced_mean = float(self.trainer.strategy.reduce(r.sum(), reduce_op="mean"))
        self.broadcast = self.trainer.strategy.broadcast({"from": self.global_rank})
        self.decision_any = self.trainer.strategy.reduce_boolean_decision(self.global_rank == 1, all=False)
        self.decision_all = self.trainer.strategy.reduce_boolean_decision(self.global_rank == 1, all=True)


class LRModel(BoringModel):
    """BoringModel with a tunable ``lr`` and ``batch_size`` (what the Tuner looks for)."""

    def __init__(self, lr: float = 0.1, batch_size: int = 1):
        super().__init__()
        self.lr, self.batch_size = lr, batch_size

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 64), batch_size=self.batch_size)


class UnusedParameter(LoggingBoring):
    """A parameter that takes no part in the loss (DDP needs find_unused_parameters=True)."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(32, 3)


class DropoutBoring(LoggingBoring):
    """BoringModel with dropout: training draws from the global RNG."""

    def __init__(self):
        super().__init__()
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.layer(self.dropout(x))


class TwoDataloaders(LoggingBoring):
    """Two validation dataloaders: metrics are suffixed per dataloader."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_loss", self.step(batch), sync_dist=True)

    def val_dataloader(self):
        return [DataLoader(RandomDataset(32, 16), batch_size=4), DataLoader(RandomDataset(32, 8), batch_size=4)]


# ------------------------------------------------------------------ what a scenario reports


def weights(module: torch.nn.Module) -> dict[str, float]:
    params = [p.detach().double() for p in module.parameters()]
    return {"sum": float(sum(p.sum() for p in params)), "sq": float(sum((p * p).sum() for p in params)),
            "n": sum(p.numel() for p in params)}


def metrics(d: dict) -> dict[str, float]:
    return {k: float(v) for k, v in sorted(d.items())}


def error(e: BaseException) -> str:
    text = str(e).strip()
    return f"error: {type(e).__name__}: {text.splitlines()[0] if text else ''}"


def state(trainer: L.Trainer) -> dict[str, Any]:
    return {"global_step": trainer.global_step, "epoch": trainer.current_epoch, "status": str(trainer.state.status),
            "should_stop": bool(trainer.should_stop), "world": trainer.world_size,
            "is_ddp": isinstance(trainer.strategy, DDPStrategy)}


class Suite:
    def __init__(self, strategy: str, out: Path, devices: int, resume_from: Optional[str] = None):
        self.strategy, self.out, self.devices, self.resume_from = strategy, out, devices, resume_from

    def trainer(self, name: str, **kw: Any) -> L.Trainer:
        base = dict(accelerator="cpu", devices=self.devices, strategy=self.strategy, logger=False,
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                    num_sanity_val_steps=0, default_root_dir=str(self.root(name)))
        base.update(kw)
        return L.Trainer(**base)

    def root(self, name: str) -> Path:
        path = self.out / "work" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    # -------------------------------------------------------------- the scenarios, in the order they run

    def boring_fit(self):
        """BoringModel + BoringDataModule: fit with validation (StepLR scheduler, SGD)."""
        model = LoggingBoring()
        trainer = self.trainer("boring_fit", max_epochs=2, limit_train_batches=4, limit_val_batches=3)
        dm = BoringDataModule()
        trainer.fit(model, datamodule=dm)
        out = {**state(trainer), "weights": weights(model), "metrics": metrics(trainer.callback_metrics),
               "lr": trainer.optimizers[0].param_groups[0]["lr"]}
        # the same Trainer evaluates after fit (the module unwrapped by fit's teardown)
        out["validate"] = trainer.validate(model, datamodule=dm, verbose=False)
        out["test"] = trainer.test(model, datamodule=dm, verbose=False)
        return out

    def manual_optim(self):
        """ManualOptimBoringModel: manual_backward and opt.step in training_step."""
        model = ManualOptimBoringModel()
        trainer = self.trainer("manual_optim", max_steps=5, limit_val_batches=0)
        trainer.fit(model)
        return {**state(trainer), "weights": weights(model)}

    def demo_model(self):
        """DemoModel (Adam, no val loop) on a batched RandomDataset, accumulate 2 and clip gradients."""
        model = DemoModel()
        trainer = self.trainer("demo_model", max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5)
        trainer.fit(model, DataLoader(RandomDataset(32, 64), batch_size=4))
        return {**state(trainer), "weights": weights(model)}

    def eval_loops(self):
        """validate / test / predict on a fresh BoringModel through the datamodule, then predict on a loader."""
        model, dm = LoggingBoring(), BoringDataModule()
        trainer = self.trainer("eval_loops", limit_val_batches=5, limit_test_batches=5, limit_predict_batches=6)
        val = trainer.validate(model, datamodule=dm, verbose=False)
        test = trainer.test(model, datamodule=dm, verbose=False)
        preds = trainer.predict(model, datamodule=dm)
        preds2 = trainer.predict(model, DataLoader(RandomDataset(32, 10), batch_size=3))
        return {"validate": val, "test": test, "predict": {"n": len(preds), "sum": float(torch.cat(preds).sum())},
                "predict_loader": {"n": len(preds2), "rows": sum(len(p) for p in preds2),
                                   "sum": float(torch.cat(preds2).sum())},
                "state": state(trainer)}

    def two_val_loaders(self):
        """Two validation dataloaders during fit."""
        model = TwoDataloaders()
        trainer = self.trainer("two_val_loaders", max_epochs=1, limit_train_batches=2)
        trainer.fit(model, DataLoader(RandomDataset(32, 16), batch_size=4))
        return {"metrics": metrics(trainer.callback_metrics), "weights": weights(model)}

    def sync_dist(self):
        """Per-rank values logged with sync_dist (mean/sum/max/min), log_dict, all_gather, reduce, broadcast,
        reduce_boolean_decision; CSVLogger and LearningRateMonitor."""
        model = SyncDistModel()
        root = self.root("sync_dist")
        logger = CSVLogger(str(root), name="csv", version=0)
        trainer = self.trainer("sync_dist", max_epochs=2, limit_train_batches=3, limit_val_batches=2,
                               logger=logger, log_every_n_steps=1, callbacks=[LearningRateMonitor("step")])
        trainer.fit(model, DataLoader(RandomDataset(32, 32), batch_size=4),
                    DataLoader(RandomDataset(32, 16), batch_size=4))
        out = {"callback_metrics": metrics(trainer.callback_metrics),
               "logged_metrics": metrics(trainer.logged_metrics),
               "progress_bar_metrics": metrics(trainer.progress_bar_metrics),
               "gathered": model.gathered, "reduced": model.reduced, "reduced_mean": model.reduced_mean,
               "broadcast": model.broadcast, "decision_any": model.decision_any,
               "decision_all": model.decision_all, "weights": weights(model)}
        csv = root / "csv" / "version_0" / "metrics.csv"
        if trainer.global_rank == 0:  # the logger writes on rank 0 only
            out["csv"] = csv.read_text().splitlines() if csv.exists() else None
        return out

    def early_stop_checkpoint(self):
        """EarlyStopping (mode=max on a falling val_loss: stops after patience) and ModelCheckpoint (top 2 + last,
        metric in the file name) across ranks; then load the best checkpoint and resume from last.ckpt."""
        model = LoggingBoring()
        ckdir = self.root("early_stop_checkpoint") / "ckpt"
        ckpt = ModelCheckpoint(dirpath=str(ckdir), monitor="val_loss", mode="min", save_top_k=2, save_last=True,
                               filename="{epoch}-{val_loss:.4f}")
        stop = EarlyStopping(monitor="val_loss", mode="max", patience=1)
        trainer = self.trainer("early_stop_checkpoint", max_epochs=6, limit_train_batches=2, limit_val_batches=2,
                               enable_checkpointing=True, callbacks=[ckpt, stop])
        trainer.fit(model, datamodule=BoringDataModule())
        trainer.strategy.barrier()
        out = {**state(trainer), "weights": weights(model), "stopped_epoch": stop.stopped_epoch,
               "wait_count": stop.wait_count, "best_score": float(ckpt.best_model_score),
               "best_path": os.path.basename(ckpt.best_model_path), "last_path": os.path.basename(ckpt.last_model_path),
               "best_k": {os.path.basename(k): float(v) for k, v in sorted(ckpt.best_k_models.items())},
               "files": sorted(os.listdir(ckdir))}
        loaded = torch.load(ckpt.best_model_path, map_location="cpu", weights_only=False)
        out["best_ckpt"] = {"epoch": loaded["epoch"], "global_step": loaded["global_step"],
                            "weights": float(sum(v.double().sum() for v in loaded["state_dict"].values())),
                            # HorizonStrategy adds its own key (per-rank part state); every other key must match
                            "keys": sorted(k for k in loaded if k != "HorizonStrategy"),
                            "callbacks": sorted(loaded.get("callbacks", {}))}
        user = str(self.root("early_stop_checkpoint") / "user.ckpt")
        trainer.save_checkpoint(user, weights_only=True)  # a user's own save: every rank calls it
        trainer.strategy.barrier()
        out["user_ckpt"] = {"keys": sorted(k for k in torch.load(user, weights_only=False) if k != "HorizonStrategy"),
                            "loaded": weights(LoggingBoring.load_from_checkpoint(user))}
        resumed = LoggingBoring()
        t2 = self.trainer("early_stop_checkpoint_resume", max_epochs=trainer.current_epoch + 2, limit_train_batches=2,
                          limit_val_batches=2)
        t2.fit(resumed, datamodule=BoringDataModule(), ckpt_path=ckpt.last_model_path)
        out["resumed"] = {**state(t2), "weights": weights(resumed), "metrics": metrics(t2.callback_metrics)}
        return out

    def evaluate_checkpoint(self):
        """validate / test / predict with ckpt_path="best" after fit, on the same Trainer."""
        model = LoggingBoring()
        ckpt = ModelCheckpoint(dirpath=str(self.root("evaluate_checkpoint") / "ckpt"), monitor="val_loss")
        trainer = self.trainer("evaluate_checkpoint", max_epochs=2, limit_train_batches=2, limit_val_batches=2,
                               limit_test_batches=2, limit_predict_batches=2, enable_checkpointing=True,
                               callbacks=[ckpt])
        dm = BoringDataModule()
        trainer.fit(model, datamodule=dm)
        self.best_checkpoint = ckpt.best_model_path
        return {"best": os.path.basename(ckpt.best_model_path),
                "validate": trainer.validate(model, datamodule=dm, ckpt_path="best", verbose=False),
                "test": trainer.test(model, datamodule=dm, ckpt_path="best", verbose=False),
                "predict": float(torch.cat(trainer.predict(model, datamodule=dm, ckpt_path="best")).sum())}

    def evaluate_checkpoint_rng(self):
        """The global RNG after validate / test / predict from a checkpoint (evaluate_checkpoint's best): the next
        draws, which a predict_step that samples (or MC dropout) would take. Lightning's ddp re-seeds from the
        global seed when a stage starts (reset_seed in setup_distributed)."""
        dm, out = BoringDataModule(), {}
        trainer = self.trainer("evaluate_checkpoint_rng", limit_val_batches=1, limit_test_batches=1,
                               limit_predict_batches=1)
        out["before"] = torch.rand(2).tolist()
        trainer.validate(LoggingBoring(), datamodule=dm, ckpt_path=self.best_checkpoint, verbose=False)
        out["after_validate"] = torch.rand(2).tolist()
        trainer.test(LoggingBoring(), datamodule=dm, ckpt_path=self.best_checkpoint, verbose=False)
        out["after_test"] = torch.rand(2).tolist()
        trainer.predict(LoggingBoring(), datamodule=dm, ckpt_path=self.best_checkpoint)
        out["after_predict"] = torch.rand(2).tolist()
        return out

    def resume_checkpoint(self):
        """Resume from the other strategy's last.ckpt (--resume-from; this job's own without it): a checkpoint
        written under ddp resumes under horizon, and back, to the same outcome."""
        path = self.resume_from or str(self.root("early_stop_checkpoint") / "ckpt" / "last.ckpt")
        model = LoggingBoring()
        trainer = self.trainer("resume_checkpoint", max_epochs=4, limit_train_batches=2, limit_val_batches=2)
        trainer.fit(model, datamodule=BoringDataModule(), ckpt_path=path)
        return {**state(trainer), "weights": weights(model), "metrics": metrics(trainer.callback_metrics),
                "lr": trainer.optimizers[0].param_groups[0]["lr"]}

    def resume_dropout(self):
        """Dropout and a shuffled loader: 2 epochs, checkpoint, resume for a 3rd; and 3 epochs uninterrupted.
        (Lightning's checkpoint holds no RNG state: ddp's resumed run drops out differently from the uninterrupted
        one; HorizonStrategy restores each rank's generators, so its resumed run is the uninterrupted one.)"""
        root = self.root("resume_dropout")
        data = RandomDataset(32, 32)  # drawn once: every fit below sees the same samples
        loader = lambda: DataLoader(data, batch_size=4, shuffle=True)  # noqa: E731
        model = DropoutBoring()
        ckpt = ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True)
        self.trainer("resume_dropout", max_epochs=2, limit_val_batches=0, enable_checkpointing=True,
                     callbacks=[ckpt]).fit(model, loader())
        resumed = DropoutBoring()
        trainer = self.trainer("resume_dropout", max_epochs=3, limit_val_batches=0)
        trainer.fit(resumed, loader(), ckpt_path=ckpt.last_model_path)
        L.seed_everything(SEED, verbose=False)
        RandomDataset(32, 32)  # the same draws as before the first fit
        straight = DropoutBoring()
        self.trainer("resume_dropout", max_epochs=3, limit_val_batches=0).fit(straight, loader())
        return {**state(trainer), "resumed": weights(resumed), "uninterrupted": weights(straight),
                "first_part": weights(model)}

    def unused_parameters(self):
        """A module with an unused parameter, find_unused_parameters=True passed to the registered strategy."""
        entry = StrategyRegistry[self.strategy]
        strategy = entry["strategy"](**entry["init_params"], find_unused_parameters=True)
        model = UnusedParameter()
        trainer = self.trainer("unused_parameters", strategy=strategy, max_steps=3, limit_val_batches=0)
        trainer.fit(model, DataLoader(RandomDataset(32, 32), batch_size=4))
        return {**state(trainer), "weights": weights(model)}

    def bf16_mixed(self):
        """precision="bf16-mixed" (Lightning's autocast plugin) on BoringModel."""
        model = LoggingBoring()
        trainer = self.trainer("bf16_mixed", precision="bf16-mixed", max_steps=3, limit_val_batches=2)
        trainer.fit(model, DataLoader(RandomDataset(32, 32), batch_size=4), DataLoader(RandomDataset(32, 16)))
        return {**state(trainer), "weights": weights(model), "metrics": metrics(trainer.callback_metrics)}

    def lr_find(self):
        """Tuner.lr_find (and the model's lr updated to the suggestion)."""
        model = LRModel()
        trainer = self.trainer("lr_find", max_epochs=1, limit_val_batches=0)
        finder = Tuner(trainer).lr_find(model, min_lr=1e-4, max_lr=1.0, num_training=14, early_stop_threshold=None)
        out = {"suggestion": finder.suggestion(), "n": len(finder.results["lr"]),
               "lrs": finder.results["lr"], "losses": finder.results["loss"], "model_lr": model.lr,
               "weights_restored": weights(model),
               "leftover": sorted(p.name for p in self.root("lr_find").glob(".lr_find*"))}
        trainer.limit_train_batches = 4
        trainer.fit(model)  # the documented pattern: tune, then fit with the same Trainer
        return {**out, **state(trainer), "weights": weights(model)}

    def lr_finder_callback(self):
        """The LearningRateFinder callback inside fit, then training continues at the suggested lr."""
        model = LRModel()
        cb = LearningRateFinder(min_lr=1e-4, max_lr=1.0, num_training_steps=14, early_stop_threshold=None)
        trainer = self.trainer("lr_finder_callback", max_steps=3, limit_val_batches=0, callbacks=[cb])
        trainer.fit(model)
        return {**state(trainer), "suggestion": cb.optimal_lr.suggestion(), "model_lr": model.lr,
                "weights": weights(model)}

    def scale_batch_size(self):
        """Tuner.scale_batch_size: Lightning refuses it under a distributed strategy."""
        model = LRModel()
        trainer = self.trainer("scale_batch_size", max_epochs=1)
        found = Tuner(trainer).scale_batch_size(model, mode="power", steps_per_trial=1, max_trials=3)
        return {"found": found, "model_batch_size": model.batch_size}

    def batch_size_finder_callback(self):
        """The BatchSizeFinder callback: refused under a distributed strategy."""
        model = LRModel()
        cb = BatchSizeFinder(mode="power", steps_per_trial=1, max_trials=3)
        trainer = self.trainer("batch_size_finder_callback", max_steps=2, callbacks=[cb])
        trainer.fit(model)
        return {"found": cb.optimal_batch_size, "weights": weights(model)}

    def swa(self):
        """StochasticWeightAveraging from epoch 2 of 3 (the averaged weights replace the model's at the end)."""
        model = LoggingBoring()
        trainer = self.trainer("swa", max_epochs=3, limit_train_batches=3, limit_val_batches=0,
                               callbacks=[StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2)])
        trainer.fit(model, DataLoader(RandomDataset(32, 64), batch_size=4))
        return {**state(trainer), "weights": weights(model)}

    def ema(self):
        """EMAWeightAveraging (Lightning 2.6's WeightAveraging with an EMA): the averaged weights at the end."""
        model = LoggingBoring()
        trainer = self.trainer("ema", max_steps=6, limit_val_batches=0,
                               callbacks=[EMAWeightAveraging(decay=0.5)])
        trainer.fit(model, DataLoader(RandomDataset(32, 64), batch_size=4))
        return {**state(trainer), "weights": weights(model)}

    def _cli(self, name: str, *args: str) -> dict[str, Any]:
        return compat_cli.run(compat_cli.arguments(self.devices, self.root(name), *args))

    def _config(self, name: str) -> Path:
        # one file per rank: no rank reads what another is writing
        return compat_cli.write_config(self.root(name) / f"config_in.rank{os.environ.get('LOCAL_RANK', '0')}.yaml",
                                       self.strategy)

    def cli_args(self):
        """LightningCLI with --trainer.strategy NAME."""
        return self._cli("cli_args", f"--trainer.strategy={self.strategy}")

    def cli_config(self):
        """LightningCLI with a YAML config holding ``strategy: NAME``."""
        return self._cli("cli_config", f"--config={self._config('cli_config')}")

    def cli_command_line(self):
        """LightningCLI with the config and --trainer.strategy NAME: what test_ddp_compat.py also runs from the
        real command line (its outcome must equal this one's)."""
        return self._cli("cli_command_line", f"--config={self._config('cli_command_line')}",
                         f"--trainer.strategy={self.strategy}")

    def cli_class_path(self):
        """LightningCLI with the strategy as a class path and an init arg both share (process_group_backend)."""
        classes = {"ddp": "lightning.pytorch.strategies.DDPStrategy", "horizon": "lightning_horizon.HorizonStrategy"}
        cls = classes[self.strategy]
        return self._cli("cli_class_path", f"--trainer.strategy={cls}", "--trainer.strategy.process_group_backend=gloo")

    SCENARIOS = ("boring_fit", "manual_optim", "demo_model", "eval_loops", "two_val_loaders", "sync_dist",
                 "early_stop_checkpoint", "evaluate_checkpoint", "evaluate_checkpoint_rng", "resume_checkpoint",
                 "resume_dropout", "unused_parameters", "bf16_mixed", "lr_find", "lr_finder_callback",
                 "scale_batch_size", "batch_size_finder_callback", "swa", "ema", "cli_args", "cli_config",
                 "cli_command_line", "cli_class_path")


def main(strategy: str, out: str, devices: int = 2, only: str = "", resume_from: Optional[str] = None) -> None:
    suite = Suite(strategy, Path(out), devices, resume_from)
    names = [n for n in only.split(",") if n] or list(Suite.SCENARIOS)
    results: dict[str, Any] = {}
    for name in names:
        L.seed_everything(SEED, verbose=False)
        fn: Callable[[], Any] = getattr(suite, name)
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as e:  # every rank fails alike in these scenarios (or the job hangs and is killed)
            results[name] = error(e)
        print(f"[compat {strategy}] {name}: {time.perf_counter() - start:.2f} s", flush=True)
    # which class the name resolved to (not an outcome: the tests check that "horizon" ran HorizonStrategy)
    results["_strategy_class"] = type(suite.trainer("_meta").strategy).__qualname__
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(Path(out) / f"rank{rank}.json", "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    if dist.is_initialized():
        dist.barrier()  # rank 0 leaves only when every rank has written


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--only", default="")
    parser.add_argument("--resume-from", default=None)
    a = parser.parse_args()
    main(a.strategy, a.out, a.devices, a.only, a.resume_from)
