"""Tiny models for the sharding tests, and the fresh-process peak-RSS measurement they run.

Run as a script: ``python tests/scripts/sharding_models.py MODE [FRACTION BASE PEAK]`` builds the GPT below, runs
three training steps (AdamW) and prints one JSON line with the RSS before the first step ("base") and the
RSS high-water mark of the steps ("peak"). MODE "plain" trains unsharded; MODE "sharded" plans for a budget of
``BASE + FRACTION * (PEAK - BASE)`` from an earlier plain run, i.e. FRACTION of the unsharded activation peak.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Causal self-attention written out (not SDPA): its T x T scores are the big saved activations."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = self.attn_drop(att.masked_fill(mask, float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, d: int, dropout: float) -> None:
        super().__init__()
        self.fc, self.proj, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads, dropout)
        self.ln2, self.mlp = nn.LayerNorm(d), MLP(d, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT block stack with tied input/output embeddings; ``training_step`` returns the LM loss."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 3, seq: int = 16,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


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
    model = TinyGPT(vocab=vocab, d=64, heads=4, layers=6, seq=seq, dropout=0.1)
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
