"""Train a tiny next-token model through an injected gradient spike and a NaN step, and plot what GradNormBackoff did.

    python recipes/grad_norm_backoff_demo.py --out docs/grad_norm_backoff.png

Steps ``--spike-at`` multiply the loss by 1e6 (gradient norm ~1e5-1e6, far past spike_threshold=1e4); step
``--nan-at`` makes it NaN. The PNG shows the loss, the pre-clip gradient norm, and the scheduler's lr next to the
effective lr (scheduler lr x scale). Runs in seconds on one CPU core.
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_horizon import GradNormBackoff

VOCAB, CONTEXT = 32, 8


def markov_tokens(n: int, seed: int = 0) -> torch.Tensor:
    """A token stream from a fixed random Markov chain: learnable, so the loss has somewhere to go."""
    g = torch.Generator().manual_seed(seed)
    trans = torch.softmax(3 * torch.randn(VOCAB, VOCAB, generator=g), dim=-1)
    out = torch.empty(n, dtype=torch.long)
    out[0] = 0
    for i in range(1, n):
        out[i] = torch.multinomial(trans[out[i - 1]], 1, generator=g)
    return out


class TinyLM(L.LightningModule):
    def __init__(self, steps: int, spike_at: list[int], nan_at: list[int], lr: float = 3e-3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.mlp = nn.Sequential(nn.Linear(32 * CONTEXT, 128), nn.GELU(), nn.Linear(128, VOCAB))
        self.steps, self.spike_at, self.nan_at, self.lr = steps, set(spike_at), set(nan_at), lr
        self.tokens = markov_tokens(20_000)

    def training_step(self, batch, batch_idx):
        starts = batch  # a batch of start offsets into the token stream
        idx = starts[:, None] + torch.arange(CONTEXT + 1)
        x, y = self.tokens[idx[:, :-1]], self.tokens[idx[:, -1]]
        loss = F.cross_entropy(self.mlp(self.emb(x).flatten(1)), y)
        self.log("loss", loss, on_step=True, prog_bar=False)
        if self.global_step in self.spike_at:
            loss = loss * 1e6
        if self.global_step in self.nan_at:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        warmup = max(1, self.steps // 10)

        def warmup_cosine(s: int) -> float:
            if s < warmup:
                return (s + 1) / warmup
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, self.steps - warmup)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(L.Callback):
    """Placed after GradNormBackoff: its hook sees the lr the step really uses."""

    def __init__(self, backoff: GradNormBackoff) -> None:
        self.backoff, self.rows = backoff, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._lr_sched = trainer.optimizers[0].param_groups[0]["lr"]  # the scheduler's lr for this step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.rows.append(dict(step=trainer.global_step, grad_norm=self.backoff.last_grad_norm,
                              lr_scale=self.backoff.lr_scale, lr_used=optimizer.param_groups[0]["lr"],
                              lr_sched=self._lr_sched))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows[-1]["loss"] = float(trainer.callback_metrics["loss"])


def plot(rows: list[dict], out: str, backoff: GradNormBackoff) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    axes[0].plot(steps, [r["loss"] for r in rows])
    axes[0].set_ylabel("loss (unscaled)")
    norms = [r["grad_norm"] if math.isfinite(r["grad_norm"]) else float("nan") for r in rows]
    axes[1].semilogy(steps, norms, label="pre-clip grad norm")
    axes[1].axhline(backoff.spike_threshold, color="r", ls="--", label=f"spike_threshold={backoff.spike_threshold:g}")
    axes[1].axhline(backoff.max_norm, color="g", ls=":", label=f"max_norm={backoff.max_norm:g}")
    for r in rows:
        if not math.isfinite(r["grad_norm"]):
            axes[1].axvline(r["step"], color="k", alpha=0.4, label="non-finite: skipped")
    axes[1].legend(loc="upper right", fontsize=8)
    axes[2].plot(steps, [r["lr_sched"] for r in rows], label="scheduler lr")
    axes[2].plot(steps, [r["lr_sched"] * r["lr_scale"] for r in rows], label="effective lr (x lr_scale)")
    ax2 = axes[2].twinx()
    ax2.plot(steps, [r["lr_scale"] for r in rows], color="C3", alpha=0.5, label="lr_scale")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("lr_scale")
    axes[2].set_ylabel("lr")
    axes[2].set_xlabel("optimizer step")
    axes[2].legend(loc="lower left", fontsize=8)
    fig.suptitle("GradNormBackoff through injected spikes and a NaN step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--spike-at", type=int, nargs="*", default=[100, 101])
    ap.add_argument("--nan-at", type=int, nargs="*", default=[200])
    ap.add_argument("--recover-after", type=int, default=25)
    ap.add_argument("--out", default="docs/grad_norm_backoff.png")
    args = ap.parse_args()

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    backoff = GradNormBackoff(max_norm=1.0, spike_threshold=1e4, factor=0.8, recover_after=args.recover_after)
    recorder = Recorder(backoff)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, callbacks=[backoff, recorder],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    starts = torch.randint(0, 20_000 - CONTEXT - 1, (args.steps * 64,))
    data = torch.utils.data.DataLoader(starts, batch_size=64)
    trainer.fit(TinyLM(args.steps, args.spike_at, args.nan_at), data)
    plot(recorder.rows, args.out, backoff)
    print(f"wrote {args.out}: spikes={backoff.spikes} skipped_steps={backoff.skipped_steps} "
          f"final lr_scale={backoff.lr_scale:g} final loss={recorder.rows[-1]['loss']:.3f}")


if __name__ == "__main__":
    main()
