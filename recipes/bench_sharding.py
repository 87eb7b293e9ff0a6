"""Graph sharding against no recompute and against torch's per-block checkpointing: peak RSS and tokens/s.

usage: python recipes/bench_sharding.py [--steps 4] [--layers 6] [--seq 256] [--batch 8] [--allocator all] [--adaptive]
                                       [--fractions 0.4,0.6,1.0]

recipes/gpt.py's GPT with its attention written out (``attention="manual"``: its T x T scores make a few hundred MB
of activations) trains for a few AdamW steps in a fresh process per configuration, so that each peak RSS is the
process's own high-water mark:

- ``plain``: no recompute;
- ``per-block``: torch's ``apply_activation_checkpointing`` on every block (non-reentrant);
- ``plan@F``: GraphSharder with a budget of the plain run's resident memory plus F of its activation peak
  (each F of ``--fractions``);
- ``plan@per-block``: GraphSharder aiming at the per-block run's measured peak (equal memory, headroom 1).

``--allocator returning`` runs with glibc told to return freed blocks (see docs/sharding.md), ``glibc`` with
its defaults, ``jemalloc`` preloads jemalloc, ``all`` (default) runs each. Prints one table per allocator with
ratios against ``plain``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from gpt import Block, GPTConfig, GPTWithLoss

RETURNING = "glibc.malloc.mmap_threshold=1048576:glibc.malloc.hugetlb=1"
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
ALLOCATORS = {
    "returning": ({"GLIBC_TUNABLES": RETURNING}, f"glibc, {RETURNING}"),
    "glibc": ({}, "glibc defaults"),
    "jemalloc": ({"LD_PRELOAD": JEMALLOC}, f"LD_PRELOAD={JEMALLOC}"),
}


def run_one(cfg: dict) -> dict:
    """One configuration, in this (fresh) process."""
    from lightning_horizon.sharding import GraphSharder, ShardingConfig
    from lightning_horizon.memory.probe import current_rss, peak_rss, reset_peak_rss

    torch.manual_seed(0)
    torch.set_num_threads(cfg["threads"])
    # recipes/gpt.py's GPT with the attention written out: its T x T scores are the activations to plan around
    model = GPTWithLoss(GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"],
                                  n_head=cfg["heads"], n_embd=cfg["d"], dropout=0.1, attention="manual"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    shape = (cfg["batch"], cfg["seq"])
    data = [(torch.randint(0, cfg["vocab"], shape, generator=g), torch.randint(0, cfg["vocab"], shape, generator=g))
            for _ in range(cfg["steps"] + 1)]
    sharder = None
    if cfg["mode"] == "per-block":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        wrap = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, Block))
    elif cfg["mode"] == "plan":
        config = ShardingConfig(budget=cfg["budget"], headroom=cfg.get("headroom", 0.95),
                                adaptive=cfg.get("adaptive", False))
        sharder = GraphSharder(config, optimizers=[opt])
    base = current_rss()
    reset_peak_rss()
    peak, wall, cpu = 0, [], []
    for i, batch in enumerate(data):
        t0, c0 = time.perf_counter(), time.process_time()
        if sharder is not None:
            sharder.maybe_plan(model, batch, i)
        loss = model.training_step(batch, i)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        peak = max(peak, peak_rss())  # before after_step resets the high-water mark
        if sharder is not None:
            sharder.after_step()
        if i:  # step 0 pays for first-touch allocations and the profile
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    tokens = cfg["batch"] * cfg["seq"]
    out = {"base": base, "peak": peak, "tok_s": tokens / min(wall), "tok_cpu_s": tokens / min(cpu),
           "loss": loss.item()}
    if sharder is not None:
        out["table"] = sharder.plan_table()
        out["recompute_flops"] = sharder.plan.recompute_flops / (3 * sharder.plan.forward_flops)
        out["replans"] = [f"step {h['step']}: {h['reason']}" for h in sharder.history[1:]]
    return out


def spawn(cfg: dict, env: dict) -> dict:
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(cfg)], capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(root), **env}, cwd=root,
    )
    if proc.returncode:
        raise RuntimeError(f"{cfg['name']} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])


def bench(args: argparse.Namespace, allocator: str) -> None:
    env, label = ALLOCATORS[allocator]
    common = dict(vocab=256, d=args.d, heads=4, layers=args.layers, seq=args.seq, batch=args.batch,
                  steps=args.steps, threads=args.threads, adaptive=args.adaptive)
    rows = {"plain": spawn({**common, "name": "plain", "mode": "plain"}, env)}
    rows["per-block"] = spawn({**common, "name": "per-block", "mode": "per-block"}, env)
    base, act = rows["plain"]["base"], rows["plain"]["peak"] - rows["plain"]["base"]
    budgets = {f"plan@{f:.0%}": int(base + f * act) for f in args.fractions}
    budgets["plan@per-block"] = rows["per-block"]["peak"]
    for name, budget in budgets.items():
        # At equal memory the plan aims at the per-block run's peak itself, not 95% of it.
        headroom = 1.0 if name == "plan@per-block" else 0.95
        rows[name] = spawn({**common, "name": name, "mode": "plan", "budget": budget, "headroom": headroom}, env)
        rows[name]["budget"] = budget
    p = rows["plain"]
    print(f"\n# allocator: {allocator} ({label}); resident before the"
          f" first step {base / 2**20:.0f} MiB, plain activation peak {act / 2**20:.0f} MiB")
    print(f"{'config':<16} {'budget MiB':>10} {'peak MiB':>9} {'peak/budget':>11} {'act vs plain':>12}"
          f" {'tok/s':>8} {'x plain':>8} {'tok/cpu-s':>10} {'x plain':>8} {'recompute':>9}")
    for name, r in rows.items():
        budget = r.get("budget")
        print(f"{name:<16} {budget / 2**20 if budget else float('nan'):>10.0f} {r['peak'] / 2**20:>9.0f}"
              f" {r['peak'] / budget if budget else float('nan'):>11.3f} {(r['peak'] - base) / act:>12.2f}"
              f" {r['tok_s']:>8.0f} {r['tok_s'] / p['tok_s']:>8.2f} {r['tok_cpu_s']:>10.0f}"
              f" {r['tok_cpu_s'] / p['tok_cpu_s']:>8.2f} {r.get('recompute_flops', 0):>9.1%}")
    for name, r in rows.items():
        for line in r.get("replans", []):
            print(f"{name} re-planned at {line}")
    if args.tables:
        for name, r in rows.items():
            if "table" in r:
                print(f"\n{name}:\n{r['table']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--allocator", choices=(*ALLOCATORS, "all"), default="all")
    ap.add_argument("--fractions", type=lambda s: [float(v) for v in s.split(",") if v], default=[0.4, 0.6, 1.0],
                    help="plan@F budgets: plain's resident memory + F of its activation peak (\"\": none)")
    ap.add_argument("--tables", action="store_true", help="print each plan's table")
    ap.add_argument("--adaptive", action="store_true",
                    help="re-plan from the measured peak after every step, as in training (default: the first plan)")
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(json.loads(args.one))))
        return
    for allocator in ALLOCATORS if args.allocator == "all" else (args.allocator,):
        if allocator == "jemalloc" and not Path(JEMALLOC).exists():
            print(f"\n# allocator: jemalloc skipped ({JEMALLOC} not installed: apt-get install libjemalloc2)")
            continue
        bench(args, allocator)


if __name__ == "__main__":
    main()
