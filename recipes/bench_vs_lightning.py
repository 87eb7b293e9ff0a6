"""Head-to-head: the same GPT and data under plain Lightning and under lightning-horizon's defaults, on this machine.

    python recipes/bench_vs_lightning.py                                  # small (~10M) GPT, 3 rounds
    python recipes/bench_vs_lightning.py --config recipes/configs/tiny.yaml --steps 10 --rounds 1   # a quick look
    python recipes/bench_vs_lightning.py --smoke --layouts 1x2 --layout-arms lightning-32           # CI: seconds
    python recipes/bench_vs_lightning.py --arms horizon,horizon-foreach,horizon-compile,lightning-32  # one question
    # the defaults one at a time (each arm replaces one part by plain Lightning's):
    python recipes/bench_vs_lightning.py --arms lightning-32,horizon,horizon-nopin,horizon-noback,horizon-noplugin,
        horizon-nostrategy
    # a CPU without native bf16 (oneDNN capped at AVX2: bf16 matmuls emulated), reproduced on one with it:
    ONEDNN_MAX_CPU_ISA=AVX2 python recipes/bench_vs_lightning.py --arms lightning-32,lightning-bf16,horizon --warmup 1 --steps 3 --rounds 1
    # both ISA paths in one run, each in a child process, then horizon / best Lightning per path and round, and MFU:
    python recipes/bench_vs_lightning.py --paths native,avx2 --arms lightning-32,lightning-bf16,horizon
    # a GPT written outside this project (Hugging Face's GPT-2 at small.yaml's shapes; pip install transformers):
    python recipes/bench_vs_lightning.py --model hf-gpt2 --arms lightning-32,lightning-bf16,horizon
    python recipes/bench_vs_lightning.py --layouts all --rounds 1    # every layout (ranks x threads) of this machine
    python recipes/bench_vs_lightning.py --layouts 1x2,2x1 --layout-arms lightning-32,horizon
    # the arms in lockstep, one step each in turn (a drifting machine hits every arm alike, step by step):
    python recipes/bench_vs_lightning.py --paths native,avx2 --arms lightning-32,lightning-bf16,horizon --lockstep

Layouts: ``--layouts`` ("all": lightning_horizon.layout.candidates of this machine, or e.g. "1x2,2x1") adds an arm
``BASE@RxT`` for every layout and every base arm of ``--layout-arms`` (default: lightning-32, horizon, and
lightning-bf16 where the CPU has native bf16): R ranks of T threads (Lightning: ``devices=R``, ``"ddp"`` when R > 1,
``OMP_NUM_THREADS=T``; horizon: ``devices=R``, ``threads_per_rank=T``), plus ``horizon-tuned``: horizon with the
layout the recipe would take (the tuned one in the layout cache, else the rule). The table then shows each arm
against Lightning's default layout (one process on every core, its best precision) and against the best Lightning
arm of any layout.

Each round runs every arm once, in a rotated order (interleaved A/B, so a noisy neighbour hits all arms alike),
each in a fresh worker process: the arm's own RSS, thread pool and allocator state, nothing inherited from the
arm before it. Multi-process arms are launched by Lightning itself (its launcher re-runs the worker command for
the other ranks), as a user's script would be. A worker trains ``--warmup`` steps, then ``--steps`` measured
steps; the step time is the interval between consecutive ``on_train_batch_end`` calls on rank 0 (data loading,
forward, backward, gradient sync, optimizer). An arm's tokens/s is the median step over every measured step of
every round; the per-round medians give the min-max spread. The fp32 and bf16 matmul peaks are measured in this
process before and between rounds (the best seen), and MFU is the model's FLOPs per token (torch's FlopCounter)
times tokens/s over that peak. Each worker also measures how much CPU other processes took during its measured
window (/proc/stat minus its own ranks' CPU time); above ``--max-foreign`` (10% of the machine) the run is
repeated, up to ``--retries`` times, and the quietest attempt kept: on a shared machine this is what separates a
measurement of the arm from a measurement of the neighbours.

Below the table, each horizon arm's tokens/s over the best Lightning arm's, round by round (the two ran minutes
apart in the same round: a pair shares the machine's state, which drifts by 10% between rounds on a shared VM).
``--lockstep`` runs a round's arms (one process each) at the same time, taking turns step by step: a baton goes
round the arms, each arm holds it for one step (from one ``on_train_batch_start`` to the next: the whole loop
iteration, data included), and only the holder computes. The step time is then the time an arm held the baton, and
a round's arms met the machine's state within seconds of each other instead of minutes: on a VM whose speed drifts
by 5-20% between rounds, that is what resolves a few percent. Each round rotates who goes first; the others' load
is not measured (the other arms are it).

``--paths native,avx2`` runs the whole bench once per ISA path, each in a child process whose environment sets it
(``avx2``: ``ONEDNN_MAX_CPU_ISA=AVX2``, a CPU without native bf16; oneDNN reads the cap once per process), then
prints one row per path: the best Lightning arm, horizon's defaults, their ratio and its per-round pairs, and the
MFU of both against the peak of the dtype that path computes in.

``--smoke`` takes the smallest settings (explicit options still win): tiny.yaml, 1 warm-up + 3 measured steps, one
round, no retries, and the matmul peaks of one size (512) for 0.1 s: figures for a test, not for reading.

Every arm trains the same GPTPretrain (same init, same data order: the recipe's seeded DistributedSampler, so one
rank with batch 16 sees what two ranks with batch 8 see together; ``--model hf-gpt2``: Hugging Face's GPT-2 at the
config's shapes, recipes/hf_gpt2.py, a model written outside this project), clipped to norm 1.0 (Lightning:
``gradient_clip_val``; horizon: GradNormBackoff's ``max_norm``). Lightning's ``bf16-mixed`` refuses clipping with
a fused optimizer, so its bf16 arms use torch's foreach AdamW; every other arm uses the recipe's fused AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning_horizon.cpu import JEMALLOC_CONF, ONEDNN_ISA_VARS, isa
from lightning_horizon.layout import Layout, Machine, candidates
from lightning_horizon.layout.tuner import clean_env, run_worker
from lightning_horizon.cpu import machine_busy_seconds

sys.path.insert(0, str(Path(__file__).resolve().parent))
HERE = Path(__file__).resolve().parent

# arm -> how it is built (see _trainer_kwargs); "procs" ranks of cores/procs threads each
ARMS: dict[str, dict[str, Any]] = {
    "lightning-32": {"kind": "lightning", "strategy": "auto", "precision": "32-true", "procs": 1},
    # Lightning's MixedPrecision refuses gradient clipping with a fused optimizer ("performs unscaling of gradients
    # internally"), even for bf16: its bf16 arms clip with torch's foreach AdamW, the fastest it accepts
    "lightning-bf16": {"kind": "lightning", "strategy": "auto", "precision": "bf16-mixed", "procs": 1,
                       "model": {"optimizer_impl": "foreach"}},
    "lightning-ddp-32": {"kind": "lightning", "strategy": "ddp", "precision": "32-true", "procs": 2},
    "lightning-ddp-bf16": {"kind": "lightning", "strategy": "ddp", "precision": "bf16-mixed", "procs": 2,
                           "model": {"optimizer_impl": "foreach"}},
    "horizon": {"kind": "horizon", "procs": 1},  # the recipe's defaults on one process ("horizon-tuned": its layout)
    "horizon-2x1": {"kind": "horizon", "procs": 2},
    "horizon-fp32": {"kind": "horizon", "procs": 1, "compute": "fp32"},
    "horizon-bf16": {"kind": "horizon", "procs": 1, "compute": "bf16"},  # "auto" before it judged the model's width
    "horizon-foreach": {"kind": "horizon", "procs": 1, "model": {"optimizer_impl": "foreach"}},
    "horizon-compile": {"kind": "horizon", "procs": 1, "model": {"compile": True}},
    "horizon-eager": {"kind": "horizon", "procs": 1, "model": {"compile": False}},  # for a --config that compiles
    "horizon-sdpa": {"kind": "horizon", "procs": 1, "model": {"attention": "sdpa"}},
    "horizon-bias": {"kind": "horizon", "procs": 1, "model": {"bias": True}},  # the GPT with GPT-2's biases
    "horizon-nopin": {"kind": "horizon", "procs": 1, "strategy": {"pin_cores": False}},
    "horizon-nokeep": {"kind": "horizon", "procs": 1, "strategy": {"keep_freed_memory": False}},
    # the defaults one at a time against plain Lightning (where a tax comes from): GradNormBackoff replaced by
    # Lightning's gradient_clip_val=1.0; HorizonPrecision replaced by Lightning's precision of the same compute
    # (32-true, or bf16-mixed where "auto" computes in bf16); Lightning's own strategy with our plugin and callback
    "horizon-noback": {"kind": "horizon", "procs": 1, "backoff": False},
    "horizon-noplugin": {"kind": "horizon", "procs": 1, "precision": "same"},
    "horizon-nostrategy": {"kind": "horizon", "procs": 1, "strategy": "auto"},
    "horizon-jemalloc": {"kind": "horizon", "procs": 1, "preload": "jemalloc"},
    # jemalloc with the settings intel-extension-for-pytorch's launcher uses: never hand pages back to the OS
    "horizon-jemalloc-retain": {"kind": "horizon", "procs": 1, "preload": "jemalloc",
                                "env": {"MALLOC_CONF": JEMALLOC_CONF}},
    "horizon-tcmalloc": {"kind": "horizon", "procs": 1, "preload": "tcmalloc"},
}


def find_allocator(name: str) -> str | None:
    """The path of lib{name}.so* in the usual library folders, or None."""
    import glob

    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                   "/usr/local/lib"):
        hits = sorted(glob.glob(f"{folder}/lib{name}.so*")) + sorted(glob.glob(f"{folder}/lib{name}_minimal.so*"))
        if hits:
            return hits[0]
    return None
DEFAULT_ARMS = "lightning-32,lightning-bf16,lightning-ddp-32,lightning-ddp-bf16,horizon,horizon-2x1"
#: --smoke: the smallest run that still goes through every part of the bench (explicit options win)
SMOKE = dict(config=str(HERE / "configs" / "tiny.yaml"), warmup=1, steps=3, rounds=1, retries=0, peak_seconds=0.1,
             peak_sizes=(512,))
TUNED = "horizon-tuned"  # horizon with the layout the recipe takes: resolved by the driver into "horizon@RxT"


def arm_spec(name: str) -> dict[str, Any]:
    """``ARMS[name]``, or for a layout arm ``BASE@RxT`` the base arm on R ranks of T threads each."""
    base, _, text = name.partition("@")
    if base not in ARMS:
        raise ValueError(f"arm {name!r}: unknown {base!r}; allowed: {', '.join(ARMS)}, each optionally @RxT")
    arm = dict(ARMS[base])
    if text:
        lay = Layout.parse(text)
        arm["procs"] = lay.ranks
        if arm["kind"] == "lightning":  # Lightning has no threads option: OMP_NUM_THREADS, as its launcher sets it
            arm["strategy"] = "ddp" if lay.ranks > 1 else "auto"
            arm["env"] = {**arm.get("env", {}), "OMP_NUM_THREADS": str(lay.threads)}
        elif isinstance(arm.get("strategy", {}), dict):
            arm["strategy"] = {**arm.get("strategy", {}), "threads_per_rank": lay.threads}
        else:
            raise ValueError(f"arm {name!r}: {base!r} runs Lightning's own strategy, which has no layout")
    return arm


#: --model: the GPT every arm trains, by name -> (module, class): the recipe's own, or one written outside the project
MODELS = {"recipe": ("pretrain_gpt", "GPTPretrain"), "hf-gpt2": ("hf_gpt2", "GPT2Pretrain")}


def model_class(name: str) -> Any:
    """The LightningModule class of ``--model``; ``hf-gpt2`` needs ``transformers``, and says so."""
    import importlib

    module, cls = MODELS[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as err:
        raise RuntimeError(f"--model={name}: {err}; pip install transformers") from err


def tuned_layout(cfg: dict[str, Any]) -> tuple[Layout, str]:
    """The layout recipes/pretrain_gpt.py takes for this config by default (layout cache, else rule), and why."""
    import torch

    from lightning_horizon.layout import model_sizes, workload
    from lightning_horizon.layout.cache import CHOSEN_ENV, choose
    from lightning_horizon.memory.probe import node_free_memory
    from pretrain_gpt import GPTPretrain

    data = cfg.get("data", {})
    with torch.device("meta"):
        module = GPTPretrain(**cfg.get("model", {}))
    chosen = choose(workload(module, data.get("batch_size", 16), data.get("seq_len", 256)), *model_sizes(module),
                    free_memory=node_free_memory())
    os.environ.pop(CHOSEN_ENV, None)  # for the recipe's own ranks; the arms are told their layout
    return chosen


# ---------------------------------------------------------------------------------------------- worker side


def _trainer_kwargs(arm: dict[str, Any], steps: int, timer: Any, model: Any) -> dict[str, Any]:
    from lightning_horizon import GradNormBackoff, HorizonStrategy
    from lightning_horizon.precision import matmul_width, resolve_compute

    common = dict(accelerator="cpu", devices=arm["procs"], max_steps=steps, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    if arm["kind"] == "lightning":
        return {**common, "strategy": arm["strategy"], "precision": arm["precision"], "gradient_clip_val": 1.0,
                "callbacks": [timer]}
    from lightning_horizon.precision import HorizonPrecision

    plugin = HorizonPrecision("auto", compute=arm.get("compute", "auto"))
    strategy = arm.get("strategy", {})
    out = {**common, "strategy": HorizonStrategy(**strategy) if isinstance(strategy, dict) else strategy,
           "plugins": [plugin], "callbacks": [GradNormBackoff(max_norm=1.0), timer]}
    if arm.get("precision") == "same":  # Lightning's precision plugin, computing what HorizonPrecision would
        del out["plugins"]
        compute, _ = resolve_compute(plugin.requested_compute, "cpu", matmul_width(model))  # as its setup will
        out["precision"] = "bf16-mixed" if compute == "bf16" else "32-true"
    if arm.get("backoff") is False:
        out["callbacks"], out["gradient_clip_val"] = [timer], 1.0
    return out


class Baton:
    """Turns with the other arms of a ``--lockstep`` round: a ring of FIFOs in ``folder`` (one per arm); this arm
    waits on its own and hands on to the next arm's. The first arm starts holding it."""

    def __init__(self, folder: str, index: int, arms: int, timeout: float) -> None:
        # O_RDWR: opening never waits for the other end, and a write never fails for want of a reader
        self.mine = os.open(os.path.join(folder, str(index)), os.O_RDWR)
        self.next = os.open(os.path.join(folder, str((index + 1) % arms)), os.O_RDWR)
        self.held, self.timeout = index == 0, timeout

    def take(self) -> None:
        if not self.held:
            if not select.select([self.mine], [], [], self.timeout)[0]:
                raise TimeoutError(f"--lockstep: no turn for {self.timeout:.0f} s (another arm failed?)")
            os.read(self.mine, 1)
            self.held = True

    def give(self) -> None:
        if self.held:
            os.write(self.next, b"t")
            self.held = False


def worker(args: argparse.Namespace) -> None:
    import resource

    import lightning as L
    import psutil
    import torch
    import yaml
    from lightning.pytorch.callbacks import Callback

    from lm_data import ByteCorpusDataModule

    arm = arm_spec(args.worker)
    cfg = yaml.safe_load(Path(args.config).read_text())
    data_kw = dict(cfg.get("data", {}))
    data_kw["batch_size"] = data_kw.get("batch_size", 16) // arm["procs"]  # same global batch for every arm
    if args.cache_dir:
        data_kw["cache_dir"] = args.cache_dir
    model_kw = {**cfg.get("model", {}), **arm.get("model", {})}

    baton = None
    if args.baton:
        folder, index, arms = args.baton.rsplit(":", 2)
        baton = Baton(folder, int(index), int(arms), args.timeout)

    class Timer(Callback):
        def __init__(self) -> None:
            # --lockstep: when this arm held the baton, step by step (CLOCK_MONOTONIC: one clock for every process)
            self.turns: list[tuple[float, float]] = []
            self.turn_start: float | None = None
            self.ends: list[float] = []
            self.losses: list[float] = []
            self.rss = 0
            self.start: tuple[float, float, float] = (0.0, 0.0, 0.0)  # wall, machine busy CPU s, own CPU s
            self.usage = resource.getrusage(resource.RUSAGE_SELF)  # rank 0's page faults and system time

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if baton is not None:  # the step before ends here: hand on, wait for the next turn
                self.end_turn()
                baton.take()
                self.turn_start = time.monotonic()

        def end_turn(self) -> None:
            if self.turn_start is not None:  # (the first arm holds the baton before its first turn: it keeps it)
                self.turns.append((self.turn_start, time.monotonic()))
                baton.give()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")  # global batch loss
            self.ends.append(time.perf_counter())
            self.losses.append(float(loss))
            self.rss = max(self.rss, psutil.Process().memory_info().rss)
            if len(self.ends) == args.warmup:  # the measured window starts here
                self.start = (time.perf_counter(), machine_busy_seconds(), time.process_time())
                self.usage = resource.getrusage(resource.RUSAGE_SELF)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if baton is not None:  # the last turn (the fit's end in it: not measured)
                self.end_turn()
            wall, busy, own = (time.perf_counter() - self.start[0], machine_busy_seconds() - self.start[1],
                               time.process_time() - self.start[2])
            usage, steps = resource.getrusage(resource.RUSAGE_SELF), max(1, len(self.ends) - args.warmup)
            mine = trainer.strategy.reduce(torch.tensor([float(self.rss), own], dtype=torch.float64),
                                           reduce_op="sum")  # every rank's RSS and CPU time, summed
            if trainer.global_rank == 0:
                foreign = max(0.0, busy - float(mine[1])) / (wall * len(os.sched_getaffinity(0)))
                Path(args.out).write_text(json.dumps({
                    "ends": self.ends, "losses": self.losses, "rss_sum": float(mine[0]),
                    "threads": torch.get_num_threads(), "world": trainer.world_size,
                    "flops_per_batch": pl_module.flops_per_batch, "foreign": 0.0 if baton else foreign,
                    "turns": self.turns, "faults": (usage.ru_minflt - self.usage.ru_minflt) / steps,
                    "sys_s": (usage.ru_stime - self.usage.ru_stime) / steps,
                }))

    L.seed_everything(1337, verbose=False)
    model = model_class(args.model)(**model_kw)
    data = ByteCorpusDataModule(**data_kw)
    # --lockstep: one more step, whose turn ends with the fit (not measured)
    trainer = L.Trainer(**_trainer_kwargs(arm, args.warmup + args.steps + (1 if baton else 0), Timer(), model))
    trainer.fit(model, data)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Lightning's DDPStrategy leaves its gloo group to interpreter exit, where gloo's threads can abort the
        # process ("terminate called without an active exception")
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------- driver side


def named_arms(args: argparse.Namespace) -> list[str]:
    """The arms ``--arms`` names (without the layout arms of ``--layouts``)."""
    if args.arms == "all":  # every arm this machine can run (an allocator arm needs its library)
        return [a for a in ARMS if not ARMS[a].get("preload") or find_allocator(ARMS[a]["preload"])]
    given = args.arms if args.arms is not None else ("" if args.layouts else DEFAULT_ARMS)
    return [a.strip() for a in given.split(",") if a.strip()]


def select_arms(args: argparse.Namespace, cfg: dict[str, Any]) -> tuple[list[str], dict[str, str], str]:
    """The arms to run (row names), the worker arm of each (``horizon-tuned`` -> ``horizon@RxT``), and why the
    tuned arm has its layout ("" without one)."""
    arms = named_arms(args)
    if args.layouts:
        machine = Machine.here()
        layouts = candidates(machine.cores, machine.domains) if args.layouts == "all" else \
            [Layout.parse(t) for t in args.layouts.split(",") if t.strip()]
        bases = (["lightning-32", "horizon"] + (["lightning-bf16"] if isa().native_bf16 else [])
                 if args.layout_arms == "auto" else [b.strip() for b in args.layout_arms.split(",") if b.strip()])
        arms += [f"{b}@{lay.ranks}x{lay.threads}" for lay in layouts for b in bases]
        arms += [TUNED] if TUNED not in arms else []
    batch = cfg.get("data", {}).get("batch_size", 16)
    workers, why = {}, ""
    for a in arms:
        if a == TUNED:
            lay, why = tuned_layout(cfg)
            workers[a] = f"horizon@{lay.ranks}x{lay.threads}"
        else:
            workers[a] = a
    for a, w in workers.items():
        procs = arm_spec(w)["procs"]  # raises, naming the arm, when it is unknown
        if batch % procs:
            raise ValueError(f"arm {a}: the global batch {batch} ({args.config}) does not split over {procs} ranks")
    if not arms:
        raise ValueError(f"--arms={args.arms!r} --layouts={args.layouts!r}: no arm to run")
    return arms, workers, why


def run_arm(name: str, args: argparse.Namespace, out: Path, baton: str | None = None) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--out", str(out), "--config", args.config,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model,
           "--timeout", str(args.timeout)]
    if baton:
        cmd += ["--baton", baton]
    if args.cache_dir:
        cmd += ["--cache-dir", args.cache_dir]
    # a worker starts with the environment a user's shell would give it (as tune's workers): no thread variables, so
    # each framework's own policy decides (Lightning: cores // processes; HorizonStrategy: pinned cores), and no
    # launcher state an earlier fit in this process left behind
    env = clean_env()
    spec = arm_spec(name)
    if spec.get("preload"):
        lib = find_allocator(spec["preload"])
        if lib is None:
            raise RuntimeError(f"arm {name}: lib{spec['preload']}.so not found (apt-get install"
                               f" lib{spec['preload']}2 / google-perftools)")
        env["LD_PRELOAD"] = lib
    env.update(spec.get("env", {}))
    rc, log = run_worker(cmd, env, args.timeout)  # its own process group, killed at the end (ranks left behind)
    if rc != 0 or not out.exists():
        raise RuntimeError(f"arm {name} failed (exit {rc}):\n{log[-3000:]}")
    res = json.loads(out.read_text())
    if baton:  # the turns it held the baton
        res["intervals"] = [b - a for a, b in res["turns"][args.warmup:args.warmup + args.steps]]
    else:
        res["intervals"] = [b - a for a, b in zip(res["ends"][args.warmup - 1:], res["ends"][args.warmup:])]
    res["step_s"] = statistics.median(res["intervals"])
    res["final_loss"] = statistics.fmean(res["losses"][-min(5, len(res["losses"])):])
    return res


def run_lockstep(names: list[str], workers: dict[str, str], args: argparse.Namespace,
                 folder: Path) -> dict[str, dict[str, Any]]:
    """One ``--lockstep`` round: every arm of ``names`` (in this order round the ring) at once, one step each in
    turn."""
    from concurrent.futures import ThreadPoolExecutor

    folder.mkdir()
    for i in range(len(names)):
        os.mkfifo(folder / str(i))
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {name: pool.submit(run_arm, workers[name], args, folder / f"{name}.json",
                                     f"{folder}:{i}:{len(names)}") for i, name in enumerate(names)}
        return {name: f.result() for name, f in futures.items()}


def round_pairs(row: dict[str, Any], reference: dict[str, Any]) -> list[float]:
    """``row``'s tokens/s over ``reference``'s, round by round (each round ran every arm once, back to back)."""
    return [a / b for a, b in zip(row["rounds"], reference["rounds"])]


def matmul_peaks(seconds: float, sizes: tuple[int, ...] = (512, 1024, 2048)) -> dict[str, float]:
    import torch

    from lightning_horizon.callbacks import measure_matmul_peak

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    # emulated bf16 (no native bf16, or oneDNN capped below it) runs at a few GFLOP/s: one small size is enough
    bf16_sizes = sizes if isa().native_bf16 else sizes[:1]
    return {"fp32": measure_matmul_peak(torch.float32, sizes, seconds=seconds),
            "bf16": measure_matmul_peak(torch.bfloat16, bf16_sizes, seconds=seconds)}


#: --paths: the ISA paths a run can take, and the oneDNN cap each sets in its child's environment (None: no cap)
PATHS = {"native": None, "avx2": "AVX2"}


def drop_option(argv: list[str], name: str) -> list[str]:
    """``argv`` without ``name`` and its value (``--name v`` or ``--name=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def run_paths(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """The whole bench once per ISA path of ``--paths``, each in a child whose environment sets that path (oneDNN
    reads its cap once per process), then one line per path: horizon's defaults against the best plain Lightning
    arm, round by round, and the MFU of both against the peak of the dtype that path computes in."""
    import dataclasses
    import subprocess

    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    bad = [x for x in paths if x not in PATHS]
    if bad or not paths:
        raise ValueError(f"--paths={args.paths!r}: allowed are {', '.join(PATHS)}, comma-separated")
    uncapped = dataclasses.replace(isa(), onednn_cap="")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            if path == "native" and not uncapped.native_bf16:
                print(f"path native: {uncapped.description} has no native bf16, so it is the avx2 path", flush=True)
                if "avx2" in paths:
                    continue
            env = {k: v for k, v in os.environ.items() if k not in ONEDNN_ISA_VARS}
            if PATHS[path]:
                env["ONEDNN_MAX_CPU_ISA"] = PATHS[path]
            out = Path(tmp) / f"{path}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), *drop_option(drop_option(argv, "--paths"), "--json"),
                   "--json", str(out)]
            arms = named_arms(args)
            kept = [a for a in arms if a == TUNED or arm_spec(a).get("precision") != "bf16-mixed"]
            if kept != arms and not (uncapped.native_bf16 and not PATHS[path]):
                # emulated bf16 (20-100x slower than fp32) is no choice a user makes on that path
                print(f"path {path}: no native bf16, Lightning's bf16-mixed arms left out", flush=True)
                cmd = drop_option(cmd, "--arms") + ["--arms", ",".join(kept)]
            print(f"\n== path {path}" + (f" (ONEDNN_MAX_CPU_ISA={PATHS[path]})" if PATHS[path] else ""), flush=True)
            subprocess.run(cmd, env=env, check=True)
            results[path] = json.loads(out.read_text())
    print("\n| path | best plain Lightning | horizon defaults | horizon / best | per round | MFU Lightning |"
          " MFU horizon |\n|---|---|---|---|---|---|---|")
    for path, res in results.items():
        print(path_line(path, res))
    summary = {"paths": results}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


def path_line(path: str, res: dict[str, Any]) -> str:
    """One row of the per-path summary: the horizon arm against the best Lightning arm of that path's run; MFU
    against the peak of the dtype the path computes in (bf16 where its matmuls run in hardware, else fp32)."""
    rows = res["rows"]
    lightning = [r for r in rows if r["kind"] == "lightning"]
    horizon = next((r for r in rows if r["arm"] in ("horizon", TUNED)), None)
    if not lightning or horizon is None:
        return f"| {path} | - | - | - | - | - | - |"
    best = max(lightning, key=lambda r: r["tokens_per_sec"])
    key, peak = ("mfu_bf16", "bf16") if horizon["mfu_bf16"] is not None else ("mfu_fp32", "fp32")
    pairs = ", ".join(f"{x:.2f}" for x in round_pairs(horizon, best))
    return (f"| {path} | {best['arm']} {best['tokens_per_sec']:,.0f} tok/s | {horizon['arm']}"
            f" {horizon['tokens_per_sec']:,.0f} tok/s | {horizon['tokens_per_sec'] / best['tokens_per_sec']:.2f}x |"
            f" {pairs} | {100 * best[key]:.0f}% of {peak} | {100 * horizon[key]:.0f}% of {peak} |")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(HERE / "configs" / "small.yaml"), help="a recipe config (model + data)")
    p.add_argument("--arms", default=None, help=f"comma-separated, from: {', '.join(ARMS)}, {TUNED}, each optionally"
                   f" @RxT (ranks x threads); or all (default: {DEFAULT_ARMS}; with --layouts: none)")
    p.add_argument("--layouts", default=None, help="'all' (this machine's candidate layouts) or e.g. '1x2,2x1': adds"
                   f" BASE@RxT for each --layout-arms BASE, and {TUNED}")
    p.add_argument("--layout-arms", default="auto", help="the base arms of --layouts (auto: lightning-32, horizon,"
                   " and lightning-bf16 where the CPU has native bf16)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per arm and round")
    p.add_argument("--warmup", type=int, default=5, help="steps before measuring")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900, help="seconds per arm run")
    p.add_argument("--max-foreign", type=float, default=0.10,
                   help="rerun an arm when other processes used more than this share of the machine meanwhile")
    p.add_argument("--retries", type=int, default=2, help="reruns per arm and round when the machine was busy")
    p.add_argument("--peak-seconds", type=float, default=1.5, help="time per dtype for each matmul-peak measurement")
    p.add_argument("--cache-dir", default=None, help="token cache (default ~/.cache/lightning_horizon)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny defaults: " + ", ".join(f"{k}={v}" for k, v in
                                                                                   SMOKE.items()))
    p.add_argument("--model", default="recipe", choices=list(MODELS), help="the GPT every arm trains: the"
                   " recipe's (recipes/gpt.py) or Hugging Face's GPT-2 at the config's shapes (recipes/hf_gpt2.py)")
    p.add_argument("--paths", default=None, help="ISA paths, each a whole run in a child process, then a summary"
                   " per path: native (the CPU as it is) and/or avx2 (oneDNN capped at AVX2: a CPU without native"
                   " bf16); default: the path this process is on")
    p.add_argument("--lockstep", action="store_true", help="run each round's arms (one process each) at once,"
                   " taking turns step by step")
    p.add_argument("--baton", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.set_defaults(peak_sizes=(512, 1024, 2048))
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE)  # explicit options still win
    args = p.parse_args(argv)
    # SIGTERM as an exception, so run_arm's cleanup kills the worker's process group (it runs in its own session)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.worker:
        worker(args)
        return {}
    if args.paths:
        return run_paths(args, sys.argv[1:] if argv is None else list(argv))
    import yaml

    cfg = yaml.safe_load(Path(args.config).read_text())
    arms, workers, tuned_why = select_arms(args, cfg)
    if not 0 <= args.max_foreign <= 1 or args.retries < 0:
        raise ValueError(f"--max-foreign={args.max_foreign} --retries={args.retries}: allowed are a share in [0, 1]"
                         " and retries >= 0")
    if args.steps < 3 or args.warmup < 1 or args.rounds < 1:
        raise ValueError(f"--steps={args.steps} --warmup={args.warmup} --rounds={args.rounds}: need steps >= 3,"
                         " warmup >= 1, rounds >= 1")
    if args.lockstep and (len(arms) < 2 or any(arm_spec(workers[a])["procs"] != 1 for a in arms)):
        raise ValueError(f"--lockstep with arms {', '.join(arms)}: allowed are 2 or more arms of one process each")
    batch = cfg.get("data", {}).get("batch_size", 16)
    seq = cfg.get("data", {}).get("seq_len", 256)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"bench_vs_lightning: {args.config} | model {args.model} | global batch {batch} x {seq} tokens |"
          f" {args.warmup} warm-up +"
          f" {args.steps} measured steps | {args.rounds} round(s){' (lockstep)' if args.lockstep else ''} |"
          f" arms {', '.join(arms)} | ISA {isa().description},"
          f" native bf16: {'yes' if isa().native_bf16 else 'no'}"
          f" | {len(os.sched_getaffinity(0))} cores | {started}", flush=True)
    from lm_data import ByteCorpusDataModule

    data_kw = {k: v for k, v in cfg.get("data", {}).items() if k in ("corpus", "max_bytes")}
    ByteCorpusDataModule(**data_kw, cache_dir=args.cache_dir).prepare_data()  # build the token cache once, here
    peaks = matmul_peaks(args.peak_seconds, args.peak_sizes)
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = arms[r % len(arms):] + arms[: r % len(arms)]  # rotate: no arm always runs first or last

            def report(name: str, res: dict[str, Any], note: str) -> None:
                runs[name].append(res)
                print(f"  round {r + 1}: {name:<20} {batch * seq / res['step_s']:>9,.0f} tok/s  loss"
                      f" {res['final_loss']:.4f}  {res['faults']:>7,.0f} page faults, {1e3 * res['sys_s']:.0f} ms"
                      f" system time per step  {note}", flush=True)

            if args.lockstep:
                for name, res in run_lockstep(order, workers, args, Path(tmp) / f"r{r}").items():
                    report(name, res, f"(lockstep, {order.index(name) + 1} of {len(order)})")
            else:
                for name in order:
                    # a run during which other processes used more than --max-foreign of the machine measured the
                    # neighbours as much as the arm: run it again (up to --retries times) and keep the quietest
                    tries = []
                    for attempt in range(args.retries + 1):
                        tries.append(run_arm(workers[name], args, Path(tmp) / f"{name}.r{r}.{attempt}.json"))
                        if tries[-1]["foreign"] <= args.max_foreign:
                            break
                    res = min(tries, key=lambda t: t["foreign"])
                    report(name, res, f"others used {100 * res['foreign']:.0f}% of the machine"
                           + (f" (quietest of {len(tries)} tries)" if len(tries) > 1 else ""))
            for k, v in matmul_peaks(args.peak_seconds, args.peak_sizes).items():
                peaks[k] = max(peaks[k], v)
    tokens = batch * seq
    rows = []
    for name in arms:
        rs = runs[name]
        tps = [tokens / r["step_s"] for r in rs]  # per-round medians: the spread
        fpt = rs[0]["flops_per_batch"] * rs[0]["world"] / tokens  # FLOPs per token (forward + backward)
        # the headline: the median step over every measured step of every round (a disturbed round moves it
        # less than it moves a median of per-round medians when rounds are few)
        med = tokens / statistics.median([x for r in rs for x in r["intervals"]])
        rows.append({"foreign": max(r["foreign"] for r in rs), "arm": name, "kind": arm_spec(workers[name])["kind"],
                     "procs": rs[0]["world"], "threads": rs[0]["threads"], "tokens_per_sec": med,
                     "min": min(tps), "max": max(tps), "rounds": tps,
                     "peak_rss_mib": max(r["rss_sum"] for r in rs) / 2**20,
                     "final_loss": statistics.median(r["final_loss"] for r in rs),
                     "mfu_fp32": med * fpt / peaks["fp32"],
                     # emulated bf16 (a few GFLOP/s) is no peak a step can reach: no MFU against it
                     "mfu_bf16": med * fpt / peaks["bf16"] if isa().native_bf16 else None,
                     "turns": [r["turns"] for r in rs] if args.lockstep else None})
    lightning = [r for r in rows if r["kind"] == "lightning"]
    best = max(lightning, key=lambda r: r["tokens_per_sec"]) if lightning else None
    # Lightning's default layout: one process on every core (devices=1), whichever precision arm ran fastest
    default = max((r for r in lightning if r["procs"] == 1), key=lambda r: r["tokens_per_sec"], default=None)
    bf16 = next((r for r in rows if r["arm"] == "lightning-bf16"), None)
    finished = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"\nmatmul peak measured here ({len(os.sched_getaffinity(0))} threads, best seen): fp32"
          f" {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s | {started} .. {finished}")
    header = (f"| {'arm':<23} | procs x threads | tokens/s (min-max)     | vs best Lightning | vs Lightning default |"
              f" vs Lightning bf16 | MFU fp32 peak | MFU bf16 peak | peak RSS MiB | final loss | others' load |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        vs_best = f"{r['tokens_per_sec'] / best['tokens_per_sec']:.2f}x" if best else "-"
        vs_bf16 = f"{r['tokens_per_sec'] / bf16['tokens_per_sec']:.2f}x" if bf16 else "-"
        vs_default = f"{r['tokens_per_sec'] / default['tokens_per_sec']:.2f}x" if default else "-"
        mfu_bf16 = f"{100 * r['mfu_bf16']:.0f}%" if r["mfu_bf16"] is not None else "-"
        print(f"| {r['arm']:<23} | {r['procs']} x {r['threads']:<11} | {r['tokens_per_sec']:>8,.0f}"
              f" ({r['min']:>6,.0f}-{r['max']:<6,.0f}) | {vs_best:>17} | {vs_default:>20} | {vs_bf16:>17} |"
              f" {100 * r['mfu_fp32']:>12.0f}%"
              f" | {mfu_bf16:>13} | {r['peak_rss_mib']:>12,.0f} | {r['final_loss']:>10.4f} |"
              f" {100 * r['foreign']:>11.0f}% |")
    if best:
        print(f"best plain Lightning: {best['arm']}" + (f"; Lightning default: {default['arm']}" if default else ""))
        for r in rows:
            if r["kind"] == "horizon":  # the same round ran both arms minutes apart: a pair shares the machine's mood
                print(f"{r['arm']} / {best['arm']} per round: {', '.join(f'{x:.2f}' for x in round_pairs(r, best))}")
    if tuned_why:
        print(f"{TUNED}: {workers[TUNED].partition('@')[2]} ({tuned_why})")
    result = {"config": args.config, "started": started, "finished": finished, "peaks": peaks, "rows": rows,
              "tuned": tuned_why,
              "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "isa": isa().name}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
