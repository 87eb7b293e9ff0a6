"""Tiny models for the sharding tests, and the fresh-process peak-RSS measurement they run.

Run as a script: ``python tests/scripts/sharding_models.py MODE [FRACTION BASE PEAK]`` builds :func:`tiny_gpt`, runs
three training steps (AdamW) and prints one JSON line with the RSS before the first step ("base") and the
RSS high-water mark of the steps ("peak"). MODE "plain" trains unsharded; MODE "sharded" plans for a budget of
``BASE + FRACTION * (PEAK - BASE)`` from an earlier plain run, i.e. FRACTION of the unsharded activation peak.
"""

from __future__ import annotations

import json
import sys
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from recipes.gpt import GPTConfig, GPTWithLoss


def tiny_gpt(vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 3, seq: int = 16,
             dropout: float = 0.1) -> GPTWithLoss:
    """recipes/gpt.py's GPT, tiny, with tied embeddings and the attention written out (``attention="manual"``): its
    T x T scores are the big saved activations the planner sees. ``training_step`` returns the LM loss."""
    cfg = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=d, dropout=dropout,
                    attention="manual")
    return GPTWithLoss(cfg)


class LitGPT(L.LightningModule):
    """:func:`tiny_gpt` (4 blocks, 128 tokens, dropout) under Lightning: AdamW, the loss logged and kept per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_gpt(layers=4, seq=128, dropout=0.1)
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.net.training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())  # here, not in training_step: the profile pass runs that once more

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Branchy(nn.Module):
    """Not a chain: two towers from one input, a shared module called twice (once with a keyword argument),
    a skip connection around them, a tied weight, and a BatchNorm whose running stats must not be updated twice."""

    def __init__(self, d: int = 24, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.left = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.2), nn.Linear(4 * d, d))
        self.right = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        self.right[2].weight = self.right[0].weight  # tied
        self.shared = nn.Sequential(nn.Linear(d, 3 * d), nn.SiLU(), nn.Dropout(0.1), nn.Linear(3 * d, d))
        self.norm = nn.BatchNorm1d(d)
        self.out = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        h = self.embed(x)
        a, b = self.left(h), self.right(h)
        z = self.shared(a) + self.shared(input=b) * scale + h
        return self.out(self.norm(z))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x, scale=0.5), y)


def rss_main(argv: list[str]) -> None:
    # Import here: the tests import the models above without paying for the package.
    from lightning_horizon.sharding import GraphSharder, ShardingConfig
    from lightning_horizon.memory.probe import current_rss, peak_rss, reset_peak_rss

    mode = argv[0]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    vocab, seq, batch = 128, 256, 8
    model = tiny_gpt(vocab=vocab, d=64, heads=4, layers=6, seq=seq, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [(torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))) for _ in range(3)]
    sharder = None
    base = current_rss()
    if mode == "sharded":
        fraction, plain_base, plain_peak = float(argv[1]), int(argv[2]), int(argv[3])
        budget = int(plain_base + fraction * (plain_peak - plain_base))
        sharder = GraphSharder(ShardingConfig(budget=budget, adaptive=False), optimizers=[opt])
    # The high-water mark of each step (reset before it); their max is the run's. The sharder gets each step's
    # figure as the strategy's call would measure it.
    reset_peak_rss()
    peaks, cpu_times = [], []
    for i, b in enumerate(data):
        t0 = time.process_time()
        if sharder is not None:
            sharder.maybe_plan(model, b, i)
        loss = model.training_step(b, i)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cpu_times.append(time.process_time() - t0)
        peaks.append(peak_rss())
        reset_peak_rss()
        if sharder is not None:
            sharder.after_step(peaks[-1])
    out = {"base": base, "peak": max(peaks), "peaks": peaks, "cpu_s": cpu_times, "loss": loss.item()}
    if sharder is not None:
        out.update(budget=budget, estimate=sharder.plan.estimated_peak, table=sharder.plan_table())
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    rss_main(sys.argv[1:])
