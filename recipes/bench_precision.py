"""Tokens/s, peak RSS and bytes per parameter of recipes/gpt.py's GPT under each precision, interleaved in one process.

    python recipes/bench_precision.py --threads 1                          # ~12M-param GPT, 3 rounds
    python recipes/bench_precision.py --dim 256 --heads 4 --layers 2 --rounds 1   # quicker
    python recipes/bench_precision.py --configs "horizon auto" --compile both      # torch.compile against eager

Configs: Lightning's fp32 ("32-true") and "bf16-mixed", then HorizonPrecision's "auto" (and "auto" with compute
forced to fp32: what "auto" runs on CPUs without native bf16), bf16-true with an fp32 master and with Kahan
compensation (compute "auto"), and bf16-true + kahan with compute forced to fp32 (bf16-true on such CPUs).
``--compile on`` compiles the GPT (``torch.compile``, inductor) in every config; ``both`` runs every config eager and
compiled ("+ compile"), interleaved the same way (the compile happens in the warm-up steps, which are not timed).
Where intel_extension_for_pytorch is installed with its torch (``bash .ci/ipex`` builds that environment),
HorizonPrecision's "bf16-mixed" with ``backend="native"`` and with ``backend="ipex"`` (ipex.optimize: prepacked
weights, its fused AdamW) join the default configs; asking for the IPEX one without IPEX is an error.
Each round runs every config for ``--steps`` timed steps (after ``--warmup``), so machine noise hits all
configs alike; the median step over all rounds gives tokens/s, "spread" the (max - min) / median of the
per-round medians. On a shared machine ``--threads 1`` is much steadier.

Bytes per parameter are measured on the live tensors after a step (weights, master or compensation, grads,
optimizer state; AdamW); "analytic" is :func:`lightning_horizon.memory.bytes_per_param`. Peak RSS comes from
one extra short fit per config in a child process (its high-water mark VmHWM, reset just before the fit, minus
its resident set then), since in one process the allocator keeps what an earlier config freed. Linux only.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import lightning.pytorch as L
from gpt import ATTENTIONS, GPT, GPTConfig
from lightning_horizon import cpu
from lightning_horizon.memory.probe import current_rss, peak_rss, reset_peak_rss
from lightning_horizon.memory import bytes_per_param, held_bytes
from lightning_horizon.precision import HorizonPrecision, ipex_status


class LitGPT(L.LightningModule):
    """recipes/gpt.py's GPT (no dropout) on a batch of ``seq + 1`` tokens per row, AdamW."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int, attention: str = "sdpa") -> None:
        super().__init__()
        self.net = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=dim,
                                 dropout=0.0, attention=attention))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)


class Probe(L.Callback):
    """Step times after warmup, and the bytes held after the last step."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.held = warmup, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self.t0)
        self.held = held_bytes(pl_module, trainer.optimizers, trainer.precision_plugin)


CONFIGS = {
    "fp32 (32-true)": lambda: {"precision": "32-true"},
    "lightning bf16-mixed": lambda: {"precision": "bf16-mixed"},
    "horizon auto": lambda: {"plugins": [HorizonPrecision("auto")]},
    "horizon auto, compute=fp32 (as on AVX2)": lambda: {"plugins": [HorizonPrecision("auto", compute="fp32")]},
    "horizon bf16-true fp32-master": lambda: {"plugins": [HorizonPrecision("bf16-true", master="fp32")]},
    "horizon bf16-true kahan": lambda: {"plugins": [HorizonPrecision("bf16-true", master="kahan")]},
    "horizon bf16-true kahan compute=fp32": lambda: {
        "plugins": [HorizonPrecision("bf16-true", master="kahan", compute="fp32")]
    },
    "horizon bf16-mixed native": lambda: {"plugins": [HorizonPrecision("bf16-mixed", backend="native")]},
    "horizon bf16-mixed ipex": lambda: {"plugins": [HorizonPrecision("bf16-mixed", backend="ipex")]},
}
IPEX_CONFIGS = ("horizon bf16-mixed native", "horizon bf16-mixed ipex")
ANALYTIC = {"fp32 (32-true)": ("fp32", None), "lightning bf16-mixed": ("bf16-mixed", None),
            "horizon auto": ("auto", None), "horizon auto, compute=fp32 (as on AVX2)": ("auto", None),
            "horizon bf16-true fp32-master": ("bf16-true", "fp32"),
            "horizon bf16-true kahan": ("bf16-true", "kahan"),
            "horizon bf16-true kahan compute=fp32": ("bf16-true", "kahan"),
            "horizon bf16-mixed native": ("bf16-mixed", None), "horizon bf16-mixed ipex": ("bf16-mixed", None)}


COMPILED = " + compile"


def run_one(label: str, args: argparse.Namespace, data: torch.Tensor) -> Probe:
    """One fit of the config ``label`` names (a config of CONFIGS, compiled where it ends in COMPILED)."""
    torch.manual_seed(0)
    model = LitGPT(args.vocab, args.dim, args.layers, args.heads, args.seq, args.attention)
    name = label.removesuffix(COMPILED)
    if name != label:
        model.net.compile()
    probe = Probe(args.warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe], **CONFIGS[name](),
    )
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch)
    trainer.fit(model, loader)
    probe.params = sum(p.numel() for p in model.parameters())
    return probe


def markov_tokens(n: int, seq: int, vocab: int) -> torch.Tensor:
    """Token sequences from a fixed random sparse Markov chain: learnable structure, no download."""
    g = torch.Generator().manual_seed(1)
    nxt = torch.randint(0, vocab, (vocab, 4), generator=g)
    out = torch.empty(n, seq + 1, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(seq):
        out[:, t + 1] = nxt[out[:, t], torch.randint(0, 4, (n,), generator=g)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--attention", choices=ATTENTIONS, default="sdpa",
                    help="recipes/gpt.py's GPTConfig.attention (default sdpa: one kernel for every precision)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per config and round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="1 is steadier on a shared machine")
    ipex, why = ipex_status()
    default = [n for n in CONFIGS if ipex is not None or n not in IPEX_CONFIGS]
    ap.add_argument("--configs", nargs="*", default=default, choices=list(CONFIGS))
    ap.add_argument("--compile", choices=("off", "on", "both"), default="off",
                    help="torch.compile the GPT: in no config, in every config, or each config both ways")
    ap.add_argument("--rss-of", help=argparse.SUPPRESS)  # the child that measures peak RSS of one label
    args = ap.parse_args()
    if ipex is None and "horizon bf16-mixed ipex" in args.configs:
        ap.error(f"--configs 'horizon bf16-mixed ipex' needs IPEX: {why}")
    if args.rss_of is not None and args.rss_of.removesuffix(COMPILED) not in CONFIGS:
        ap.error(f"--rss-of {args.rss_of!r}: allowed is a config of --configs, optionally ending in {COMPILED!r}")
    labels = {"off": [""], "on": [COMPILED], "both": ["", COMPILED]}[args.compile]
    args.configs = [name + suffix for name in args.configs for suffix in labels]
    torch.set_num_threads(args.threads)
    data = markov_tokens(args.batch * (args.warmup + args.steps), args.seq, args.vocab)
    if args.rss_of:
        gc.collect()
        reset_peak_rss()  # the high-water mark (VmHWM) down to now: the imports peaked higher
        base = current_rss()
        run_one(args.rss_of, args, data)
        print(f"RSS {peak_rss() - base}")
        return
    print(f"ISA: {cpu.isa().description}; native bf16: {cpu.isa().native_bf16}; torch {torch.__version__}; "
          f"IPEX: {ipex.__version__ if ipex is not None else why}; threads {args.threads}")

    results: dict[str, list[Probe]] = {label: [] for label in args.configs}
    for r in range(args.rounds):
        for name in args.configs:
            results[name].append(run_one(name, args, data))
            ms = statistics.median(results[name][-1].times) * 1e3
            print(f"  round {r + 1}/{args.rounds} {name}: {ms:.0f} ms/step", flush=True)

    peaks = {}
    for name in args.configs:
        same = [f"--{k}={getattr(args, k)}" for k in ("vocab", "dim", "layers", "heads", "seq", "batch", "steps",
                                                          "warmup", "threads", "attention")]
        out = subprocess.run([sys.executable, __file__, *same, f"--rss-of={name}"], capture_output=True, text=True,
                             check=True).stdout
        peaks[name] = int(out.split("RSS ")[-1].split()[0])

    tokens = args.batch * args.seq
    base_name = args.configs[0]
    speed = {n: tokens / statistics.median([t for p in ps for t in p.times]) for n, ps in results.items()}
    fp32_bytes = results[base_name][-1].held["total"]
    n_params = results[base_name][-1].params
    print(f"\nGPT {n_params / 1e6:.2f}M params, batch {args.batch} x {args.seq} tokens, AdamW; ratios against "
          f"{base_name!r}; bytes/param held after a step (weights + master/comp + grads + optimizer state)")
    print(f"{'config':50s} {'tok/s':>8s} {'ratio':>6s} {'spread':>6s} {'peakRSS MB':>10s}  {'w':>4s} {'m':>4s} "
          f"{'g':>4s} {'s':>4s} {'B/param':>7s} {'analytic':>8s} {'vs fp32':>7s}")
    for name, probes in results.items():
        held = probes[-1].held
        per = {k: v / n_params for k, v in held.items()}
        config = name.removesuffix(COMPILED)
        analytic = bytes_per_param(*ANALYTIC[config])["total"] if config in ANALYTIC else float("nan")
        peak = peaks[name] / 2**20
        rounds = [statistics.median(p.times) for p in probes]  # (max - min) / median of the per-round medians
        spread = (max(rounds) - min(rounds)) / statistics.median(rounds)
        print(f"{name:50s} {speed[name]:8.0f} {speed[name] / speed[base_name]:6.2f} {spread:6.0%} {peak:10.0f}  "
              f"{per['weights']:4.1f} {per['master']:4.1f} {per['grads']:4.1f} {per['state']:4.1f} "
              f"{per['total']:7.2f} {analytic:8d} {held['total'] / fp32_bytes:7.1%}")


if __name__ == "__main__":
    main()
