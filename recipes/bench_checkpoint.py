"""What a checkpoint costs per step: the recipe GPT trained with a checkpoint every N steps against the same steps
without one, side by side in one run, written in the background (AtomicCheckpointIO(background=True)) or in the step.

    python recipes/bench_checkpoint.py                                   # small.yaml, N = 10, 100 steps per arm
    python recipes/bench_checkpoint.py --config recipes/configs/125m.yaml --steps 50 --warmup 3
    python recipes/bench_checkpoint.py --smoke                           # tiny.yaml, seconds (the test)

One fit per arm (``background``, ``sync``), one rank with every core, the recipe's checkpoint path (HorizonStrategy
gathers the parts' state, ``trainer.save_checkpoint`` writes ``last.ckpt`` atomically on the local disk, as
ModelCheckpoint does). After ``--warmup`` steps the fit alternates blocks of N steps: a block that begins with a
checkpoint (the save at its first step's end, its background write overlapping the block's steps) and a block
without one. Each pair of neighbouring blocks is timed on the same clock a few seconds apart, so that a machine
whose speed drifts (shared, throttled) moves both alike; the cost is the median over the pairs of (time of the
checkpoint block / time of the clean block) - 1: what a checkpoint every N steps costs in tokens/s. Prints one line
per arm; ``--json`` writes every block's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from _bench import cpu_line  # noqa: E402
from lm_data import ByteCorpusDataModule  # noqa: E402
from pretrain_gpt import GPTPretrain  # noqa: E402

from lightning_horizon import AtomicCheckpointIO, HorizonStrategy  # noqa: E402

ARMS = ("background", "sync")
REPO = Path(__file__).resolve().parent.parent


class Alternate(L.Callback):
    """Times every optimizer step's end and, from ``warmup`` on, saves at the start of every other block of
    ``every`` steps (the time taken before the save: the save counts in the block it begins)."""

    def __init__(self, every: int, warmup: int, path: Path) -> None:
        self.every, self.warmup, self.path = every, warmup, path
        self.ends: dict[int, float] = {}
        self.saves: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step in self.ends:
            return  # an accumulation micro-batch: the optimizer step has not moved
        self.ends[step] = time.perf_counter()
        if step >= self.warmup and (step - self.warmup) % (2 * self.every) == 0:
            trainer.save_checkpoint(self.path)
            self.saves.append(step)


def fit_arm(arm: str, cfg: dict, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    L.seed_everything(1337, verbose=False)
    model = GPTPretrain(**cfg["model"])
    data = ByteCorpusDataModule(**{**cfg["data"], "cache_dir": args.cache_dir})
    clock = Alternate(args.every, args.warmup, work / arm / "last.ckpt")
    strategy = HorizonStrategy(checkpoint_io=AtomicCheckpointIO(background=arm == "background"))
    accumulate = cfg.get("trainer", {}).get("accumulate_grad_batches", 1)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, callbacks=[clock], max_steps=args.steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, enable_checkpointing=False, default_root_dir=work / arm,
                        accumulate_grad_batches=accumulate)
    trainer.fit(model, data)
    t, n = clock.ends, args.every
    pairs = [(t[s + n] - t[s], t[s + 2 * n] - t[s + n]) for s in clock.saves if s + 2 * n in t]
    tokens = n * cfg["data"]["batch_size"] * cfg["data"]["seq_len"] * accumulate
    ckpt = work / arm / "last.ckpt"
    return {"arm": arm, "pairs": len(pairs), "cost": statistics.median(a / b - 1 for a, b in pairs) if pairs else None,
            "tokens_per_s_with": tokens * len(pairs) / sum(a for a, _ in pairs) if pairs else None,
            "tokens_per_s_without": tokens * len(pairs) / sum(b for _, b in pairs) if pairs else None,
            "blocks_s": pairs, "checkpoint_mb": ckpt.stat().st_size / 2**20 if ckpt.exists() else 0.0}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "recipes/configs/small.yaml"))
    parser.add_argument("--steps", type=int, default=105, help="optimizer steps per arm")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the first block")
    parser.add_argument("--every", type=int, default=10, help="a checkpoint every N optimizer steps")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--cache-dir", default=None, help="the corpus cache (lm_data)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny.yaml, a checkpoint every 2 steps, 13 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.steps, args.warmup, args.every = str(REPO / "recipes/configs/tiny.yaml"), 13, 1, 2
    cfg = yaml.safe_load(Path(args.config).read_text())
    cfg.setdefault("data", {})
    cfg["data"].setdefault("seq_len", 256)
    cfg["data"].setdefault("batch_size", 16)
    if args.smoke:
        cfg["data"]["max_bytes"] = min(cfg["data"].get("max_bytes", 2**20), 2**20)
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        parser.error(f"--arms {sorted(unknown)}: allowed are {ARMS}")
    print(cpu_line(), flush=True)
    fits = []
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        for arm in arms:
            fit = fit_arm(arm, cfg, args, Path(tmp))
            fits.append(fit)
            if fit["cost"] is None:
                print(f"{arm}: no pair of blocks (raise --steps)")
                continue
            print(f"{arm}: a checkpoint every {args.every} steps costs {100 * fit['cost']:.1f}% of tokens/s (median"
                  f" of {fit['pairs']} pairs; {fit['tokens_per_s_with']:.0f} tokens/s with, "
                  f"{fit['tokens_per_s_without']:.0f} without), checkpoint {fit['checkpoint_mb']:.1f} MiB", flush=True)
    result = {"config": args.config, "every": args.every, "steps": args.steps, "cpu": cpu_line(),
              "cores": os.cpu_count(), "threads": torch.get_num_threads(), "fits": fits}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
