"""Pretrain a byte-level GPT on a text corpus on CPUs, with lightning-horizon's defaults.

    python recipes/pretrain_gpt.py                                   # the README job: a few minutes on 2 cores
    python recipes/pretrain_gpt.py fit --config recipes/configs/tiny.yaml          # CI-sized
    python recipes/pretrain_gpt.py fit --config recipes/configs/small.yaml         # ~10M parameters
    python recipes/pretrain_gpt.py fit --config recipes/configs/small.yaml --ckpt_path last   # resume
    python recipes/pretrain_gpt.py fit --data.corpus ~/my_texts --trainer.devices 2           # your data, 2 ranks
    python recipes/pretrain_gpt.py fit --print_config                                         # every option
    python -m lightning_horizon.tune recipes/pretrain_gpt.py --config recipes/configs/small.yaml   # tune the layout

The command line is LightningCLI: the options are the signatures of ``GPTPretrain`` (model and optimizer),
``ByteCorpusDataModule`` (data) and the Trainer, plus one section per always-on callback (``backoff``,
``throughput``, ``memory``, ``comm``, ``checkpoint``, ``preemption``, ``report``). Defaults: HorizonStrategy,
HorizonPrecision("auto") (bf16 matmuls only where the CPU has native bf16), GradNormBackoff, a CSV logger and
checkpoints (``last.ckpt``) under ``trainer.default_root_dir``, written in the background (a snapshot in memory, the
atomic write on a thread while the next steps run), and PreemptionCheckpoint (a SIGTERM writes ``last.ckpt`` at the
next step's end on every rank, then the fit ends). Recovery without a person (docs/reliability.md):

    torchrun --nproc-per-node 2 --max-restarts 3 recipes/pretrain_gpt.py fit --config recipes/configs/small.yaml \
        --ckpt_path last --checkpoint.every_n_train_steps 10 At the end it prints tokens/s and the final validation perplexity, and writes
``loss_curve.png`` next to the logs.

The layout (ranks x threads per rank) is this model's tuned one on this machine (``python -m lightning_horizon.tune``,
cached), else a rule from the machine and the model's size, with ``data.batch_size`` as the global batch split over
the ranks; the log says which it took and why. ``--trainer.devices`` or ``--trainer.strategy.threads_per_rank``
choose your own (``data.batch_size`` is then per rank). See docs/layout.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpt.py, lm_data.py, report.py sit next to this file

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from torchmetrics.text import Perplexity

from _cli import FitByDefaultParser, auto_layout, csv_logger_under, drop_unset_ddp_args, horizon_precision_default
from gpt import GPT, GPTConfig
from lm_data import VOCAB_SIZE, ByteCorpusDataModule
from report import TrainingReport

from lightning_horizon import (AtomicCheckpointIO, CommMonitor, GradNormBackoff, MemoryMonitor, PreemptionCheckpoint,
                               ThroughputMFUMonitor)

log = logging.getLogger("lightning_horizon.recipes")

OPTIMIZERS = ("fused", "foreach", "for-loop")


def model_flops(cfg: GPTConfig, batch: int, seq_len: int) -> int:
    """FLOPs of one training step (forward + backward) of ``batch x seq_len`` tokens, counted by torch's FlopCounter
    on a meta copy (no memory). The model's FLOPs, as MFU counts them (PaLM's convention): the whole causal attention
    matrix, whichever attention path runs (the count of the flash kernel's call), not the fewer FLOPs the blocked
    path computes, so that a faster attention path shows as a higher MFU."""
    with torch.device("meta"):
        meta = GPT(dataclasses.replace(cfg, attention="sdpa"))
        x = torch.zeros(batch, seq_len, dtype=torch.long)
        return measure_flops(meta, lambda: meta(x), lambda y: y.float().sum())


class GPTPretrain(L.LightningModule):
    """A GPT trained for next-token prediction with AdamW, linear warm-up and cosine decay.

    Args:
        n_layer: transformer blocks.
        n_head: attention heads (divides ``n_embd``).
        n_embd: residual width.
        block_size: longest context; the data's ``seq_len`` must not exceed it.
        vocab_size: vocabulary (256: bytes).
        dropout: dropout on attention and residual branches.
        attention: ``"auto"``, ``"sdpa"``, ``"manual"`` or ``"blocked"`` (see ``GPTConfig.attention``: measured per
            dtype and length).
        gelu: the MLP's GELU, ``"none"`` (exact) or ``"tanh"`` (GPT-2's approximation; see ``GPTConfig.gelu``).
        bias: biases in the Linear and LayerNorm layers. Off by default (as in PaLM and LLaMA; GPT-2 has them):
            measured faster, the loss no higher (see ``GPTConfig.bias``). ``True`` for checkpoints trained with them.
        lr: peak learning rate.
        min_lr_ratio: the cosine decays to ``lr * min_lr_ratio`` at the last step.
        warmup_steps: linear warm-up steps.
        weight_decay: AdamW weight decay, applied to matrices only (not to biases and norms).
        betas: AdamW betas.
        optimizer_impl: AdamW's kernel: ``"fused"`` (one fused kernel per parameter), ``"foreach"`` (torch's
            multi-tensor default) or ``"for-loop"``.
        compile: wrap the model in ``torch.compile`` (inductor).
    """

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 256,
        block_size: int = 256,
        vocab_size: int = VOCAB_SIZE,
        dropout: float = 0.0,
        attention: str = "auto",
        gelu: str = "none",
        bias: bool = False,
        lr: float = 2e-3,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 50,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        optimizer_impl: str = "fused",
        compile: bool = False,
    ) -> None:
        super().__init__()
        if optimizer_impl not in OPTIMIZERS:
            raise ValueError(f"GPTPretrain(optimizer_impl={optimizer_impl!r}): allowed are {OPTIMIZERS}")
        if not lr > 0 or not 0 <= min_lr_ratio <= 1:
            raise ValueError(f"GPTPretrain(lr={lr!r}, min_lr_ratio={min_lr_ratio!r}): allowed are lr > 0 and"
                             " min_lr_ratio in [0, 1]")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"GPTPretrain(warmup_steps={warmup_steps!r}): allowed is an int >= 0")
        self.save_hyperparameters()
        self.cfg = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                             n_embd=n_embd, dropout=dropout, attention=attention, gelu=gelu, bias=bias)
        self.model = GPT(self.cfg)
        self.val_ppl = Perplexity()
        self.flops_per_batch: Optional[int] = None  # read by ThroughputMonitor

    def setup(self, stage: str) -> None:
        dm = self.trainer.datamodule if self.trainer is not None else None
        if dm is None:
            return
        if getattr(dm, "vocab_size", self.cfg.vocab_size) != self.cfg.vocab_size:
            raise ValueError(f"GPTPretrain(vocab_size={self.cfg.vocab_size}): the data has {dm.vocab_size} tokens")
        if dm.seq_len > self.cfg.block_size:
            raise ValueError(f"data.seq_len={dm.seq_len} exceeds model.block_size={self.cfg.block_size}:"
                             " lower the one or raise the other")
        self.flops_per_batch = model_flops(self.cfg, dm.batch_size, dm.seq_len)

    def configure_model(self) -> None:
        if self.hparams.compile and not getattr(self, "_compiled", False):
            self.model.compile()  # in place: state_dict keys stay free of torch.compile's "_orig_mod." prefix
            self._compiled = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())  # the softmax in fp32 whatever the matmuls

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self._loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x).float()
        self.val_ppl.update(logits, y)
        self.log("val_loss", self._loss(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_ppl", self.val_ppl, prog_bar=True)  # torchmetrics reduces across ranks itself

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr, betas=tuple(hp.betas), **kernel[hp.optimizer_impl],
        )
        total = max(1, self.trainer.estimated_stepping_batches)
        warmup = min(hp.warmup_steps, total // 2)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": "auto",  # auto: the tuned layout of this model on this machine, else the rule (docs/layout.md)
    "strategy": {"class_path": "lightning_horizon.HorizonStrategy"},
    "plugins": horizon_precision_default(),
    "max_steps": 600,
    "val_check_interval": 200,
    "limit_val_batches": 20,
    "check_val_every_n_epoch": None,  # validate by steps, also across epoch boundaries
    "log_every_n_steps": 10,
    "num_sanity_val_steps": 0,
    "default_root_dir": "runs/pretrain_gpt",
}


class HorizonCLI(LightningCLI):
    """LightningCLI with lightning-horizon's always-on callbacks as config sections and run-dir wiring."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(GradNormBackoff, "backoff")
        parser.add_lightning_class_args(ThroughputMFUMonitor, "throughput")
        parser.add_lightning_class_args(MemoryMonitor, "memory")
        parser.add_lightning_class_args(CommMonitor, "comm")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.add_lightning_class_args(PreemptionCheckpoint, "preemption")
        parser.add_lightning_class_args(TrainingReport, "report")
        parser.set_defaults({
            "checkpoint.save_last": True,
            "checkpoint.every_n_train_steps": 200,
            "checkpoint.save_top_k": 0,  # last.ckpt only: the recipe resumes, it does not select
            # the monitors log every trainer.log_every_n_steps (10); a summary line each every 50 steps is plenty
            "throughput.summary_every_n_steps": 50,
            "memory.summary_every_n_steps": 50,
            "comm.summary_every_n_steps": 50,
        })

    def before_instantiate_classes(self) -> None:
        # One knob for where a run lives: checkpoints and the CSV logs follow trainer.default_root_dir unless set.
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        root = cfg.trainer.default_root_dir or TRAINER_DEFAULTS["default_root_dir"]
        if cfg.checkpoint.dirpath is None:
            cfg.checkpoint.dirpath = os.path.join(root, "checkpoints")
        drop_unset_ddp_args(cfg.trainer.strategy)
        csv_logger_under(cfg, root)
        taken = auto_layout(cfg, GPTPretrain, "recipes/pretrain_gpt.py")
        if taken:
            log.info("pretrain_gpt: %s", taken)

    def after_instantiate_classes(self) -> None:
        super().after_instantiate_classes()
        # the recipe's checkpoints in the background: a checkpoint every 10 steps costs little (docs/reliability.md)
        io = getattr(self.trainer.strategy, "checkpoint_io", None) if getattr(self, "trainer", None) else None
        if type(io) is AtomicCheckpointIO and not io.background:
            io.background = True


def main(args: Optional[list[str]] = None, run: bool = True) -> HorizonCLI:
    """Parse ``args`` (``None``: the command line), build model, data and Trainer, and run the subcommand (none
    given: ``fit``; with ``run=False``: only build them, and ``args`` has no subcommand)."""
    # no subcommand is fit (FitByDefaultParser): `python recipes/pretrain_gpt.py` is the README job
    if horizon_precision_default() is None:
        log.info("pretrain_gpt: lightning_horizon.precision is not installed; training in fp32")
    return HorizonCLI(
        GPTPretrain,
        ByteCorpusDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=1337,
        save_config_kwargs={"overwrite": True},
        parser_class=FitByDefaultParser,
        args=args,
        run=run,
    )


if __name__ == "__main__":
    main()
