"""What a checkpoint costs per step: the recipe GPT trained with no checkpoint, with one every N steps written in the
background (AtomicCheckpointIO(background=True)) and written in the step (the default), side by side in one process.

    python recipes/bench_checkpoint.py                                   # small.yaml, a checkpoint every 10 steps
    python recipes/bench_checkpoint.py --config recipes/configs/125m.yaml --steps 30 --rounds 1
    python recipes/bench_checkpoint.py --smoke                           # tiny.yaml, seconds (the test)

Each round fits the same model once per arm (``none``, ``background``, ``sync``; the order turns each round so that no
arm always runs first), ``--steps`` optimizer steps each, one rank with every core (the recipe's checkpoint path:
HorizonStrategy's checkpoint gathering, ModelCheckpoint(save_last=True, every_n_train_steps=N), an atomic write of
last.ckpt on the local disk). Tokens/s counts the steps after ``--warmup`` up to the last step's end, the checkpoint
writes inside that window included (a background write's tail at the very end is not: the fit's teardown waits for
it). The cost of an arm is 1 - its median tokens/s / the median of ``none``. Prints one line per fit and a summary;
``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lm_data import ByteCorpusDataModule  # noqa: E402
from pretrain_gpt import GPTPretrain  # noqa: E402

from lightning_horizon import AtomicCheckpointIO, HorizonStrategy  # noqa: E402

ARMS = ("none", "background", "sync")
REPO = Path(__file__).resolve().parent.parent


class StepClock(L.Callback):
    """The time of every batch end (before ModelCheckpoint: Lightning runs checkpoint callbacks last)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())



def fit_arm(arm: str, cfg: dict, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    L.seed_everything(1337, verbose=False)
    model = GPTPretrain(**cfg["model"])
    data = ByteCorpusDataModule(**{**cfg["data"], "cache_dir": args.cache_dir})
    clock = StepClock()
    callbacks: list[Any] = [clock]
    folder = work / arm
    if arm != "none":
        callbacks.append(ModelCheckpoint(dirpath=folder, save_last=True, every_n_train_steps=args.every,
                                         save_top_k=0))
    strategy = HorizonStrategy(checkpoint_io=AtomicCheckpointIO(background=arm == "background"))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, callbacks=callbacks, max_steps=args.steps,
                        logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, enable_checkpointing=arm != "none", default_root_dir=folder,
                        accumulate_grad_batches=cfg.get("trainer", {}).get("accumulate_grad_batches", 1))
    trainer.fit(model, data)
    # the clock's hook runs before ModelCheckpoint's: step i's end there precedes its own checkpoint, which then
    # lands inside step i + 1's interval; the window closes at the last step's end
    ends = clock.ends[:: trainer.accumulate_grad_batches] if trainer.accumulate_grad_batches > 1 else clock.ends
    window = ends[args.warmup:]
    steps = len(window) - 1
    tokens = steps * cfg["data"]["batch_size"] * cfg["data"]["seq_len"] * trainer.accumulate_grad_batches
    seconds = window[-1] - window[0]
    ckpt = folder / "last.ckpt"
    return {"arm": arm, "steps": steps, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "checkpoint_mb": ckpt.stat().st_size / 2**20 if ckpt.exists() else 0.0}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "recipes/configs/small.yaml"))
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per fit")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of tokens/s")
    parser.add_argument("--every", type=int, default=10, help="a checkpoint every N optimizer steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--cache-dir", default=None, help="the corpus cache (lm_data)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny.yaml, 8 steps, a checkpoint every 2, one round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.steps, args.warmup, args.every, args.rounds = (str(REPO / "recipes/configs/tiny.yaml"), 8,
                                                                          1, 2, 1)
    cfg = yaml.safe_load(Path(args.config).read_text())
    cfg.setdefault("data", {})
    cfg["data"].setdefault("seq_len", 256)
    cfg["data"].setdefault("batch_size", 16)
    if args.smoke:
        cfg["data"]["max_bytes"] = min(cfg["data"].get("max_bytes", 2**20), 2**20)
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        parser.error(f"--arms {sorted(unknown)}: allowed are {ARMS}")
    fits = []
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        # the process's first fit pays one-time costs (kernels, the corpus cache, allocator growth): not measured
        fit_arm("none", cfg, argparse.Namespace(**{**vars(args), "steps": args.warmup + 2}), Path(tmp) / "warm")
        for r in range(args.rounds):
            for arm in arms[r % len(arms):] + arms[: r % len(arms)]:
                fit = {"round": r, **fit_arm(arm, cfg, args, Path(tmp) / f"r{r}")}
                fits.append(fit)
                print(f"round {r} {arm:>10}: {fit['tokens_per_s']:9.0f} tokens/s over {fit['steps']} steps"
                      f" ({fit['seconds']:.1f} s), checkpoint {fit['checkpoint_mb']:.1f} MiB", flush=True)
    median = {arm: statistics.median(f["tokens_per_s"] for f in fits if f["arm"] == arm) for arm in arms}
    result = {"config": args.config, "every": args.every, "steps": args.steps, "rounds": args.rounds,
              "cpu": platform.processor() or _cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
              "median_tokens_per_s": median, "fits": fits}
    if "none" in median:
        result["cost"] = {arm: 1 - median[arm] / median["none"] for arm in arms if arm != "none"}
        for arm, cost in result["cost"].items():
            print(f"{arm}: a checkpoint every {args.every} steps costs {100 * cost:.1f}% of tokens/s"
                  f" ({median[arm]:.0f} against {median['none']:.0f} without)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
