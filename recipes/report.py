"""TrainingReport: the recipe's closing lines (tokens/s, final validation perplexity) and its loss-curve PNG.

It keeps the loss history itself (and in the checkpoint, so a resumed run plots its whole curve) rather than
re-reading the logger's files, which may not be flushed when ``on_fit_end`` runs.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

log = logging.getLogger("lightning_horizon.recipes")


class TrainingReport(Callback):
    """Record train/val losses and step times; at the end print a summary and write ``loss_curve.png``.

    Args:
        plot: write the loss-curve PNG (matplotlib, Agg backend) into the logger's directory.
        skip_first_steps: steps left out of the tokens/s figure (warm-up: first-touch allocations, caches).
    """

    def __init__(self, plot: bool = True, skip_first_steps: int = 3) -> None:
        if isinstance(skip_first_steps, bool) or not isinstance(skip_first_steps, int) or skip_first_steps < 0:
            raise ValueError(f"TrainingReport(skip_first_steps={skip_first_steps!r}): allowed is an int >= 0")
        self.plot, self.skip_first_steps = plot, skip_first_steps
        self.train: list[tuple[int, float]] = []  # (step, loss)
        self.val: list[tuple[int, float, float]] = []  # (step, loss, perplexity)
        self.tokens = 0  # trained this session (this rank's batches x world size), warm-up steps excluded
        self.seconds = 0.0  # in training steps this session, warm-up excluded
        self.session_steps = 0
        self.summary: dict[str, Any] = {}
        self.png: Optional[Path] = None
        self._t0: Optional[float] = None

    def on_train_batch_start(self, trainer: "pl.Trainer", *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        elapsed = time.perf_counter() - (self._t0 or time.perf_counter())
        self.session_steps += 1
        if self.session_steps > self.skip_first_steps:
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            self.tokens += x.numel() * trainer.world_size
            self.seconds += elapsed
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.train.append((trainer.global_step, float(loss)))

    def on_validation_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.sanity_checking:
            return
        m = trainer.callback_metrics
        if "val_loss" in m:
            ppl = float(m["val_ppl"]) if "val_ppl" in m else math.exp(float(m["val_loss"]))
            self.val.append((trainer.global_step, float(m["val_loss"]), ppl))

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        log_dir = trainer.log_dir  # a broadcast under DDP: every rank must ask, before rank 0 goes on alone
        if trainer.global_rank != 0:
            return
        model = getattr(pl_module, "model", pl_module)
        params = model.num_params() if hasattr(model, "num_params") else sum(p.numel() for p in model.parameters())
        s = {"params": params, "steps": trainer.global_step, "tokens": self.tokens, "seconds": self.seconds,
             "tokens_per_sec": self.tokens / self.seconds if self.seconds else float("nan")}
        if self.val:
            s["val_step"], s["val_loss"], s["val_ppl"] = self.val[-1]
        self.summary = s
        if self.plot and self.train:
            self.png = self._plot(Path(log_dir or trainer.default_root_dir) / "loss_curve.png")
        lines = [
            f"{params / 1e6:.2f}M parameters | {s['steps']} steps | {self.tokens:,} tokens in {self.seconds:.1f} s of"
            f" training steps (first {self.skip_first_steps} left out) | {s['tokens_per_sec']:,.0f} tokens/s",
        ]
        if self.val:
            lines.append(f"final validation (step {s['val_step']}): loss {s['val_loss']:.4f} nats/byte"
                         f" = {s['val_loss'] / math.log(2):.3f} bits/byte | perplexity {s['val_ppl']:.3f}")
        if self.png is not None:
            lines.append(f"loss curve: {self.png}")
        print("\n".join(["", "=== pretrain summary ===", *lines]), flush=True)

    def _plot(self, path: Path) -> Optional[Path]:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.info("TrainingReport: matplotlib is not installed; no loss-curve PNG (pip install matplotlib)")
            return None
        fig, ax = plt.subplots(figsize=(7, 4))
        steps, losses = zip(*self.train)
        ax.plot(steps, losses, lw=0.8, alpha=0.6, label="train loss")
        if self.val:
            vs, vl, _ = zip(*self.val)
            ax.plot(vs, vl, "o-", label="validation loss")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats per byte)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def state_dict(self) -> dict[str, Any]:
        return {"train": list(self.train), "val": list(self.val)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train = [tuple(x) for x in state_dict.get("train", [])]
        self.val = [tuple(x) for x in state_dict.get("val", [])]
