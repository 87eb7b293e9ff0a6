"""Benchmark: out-of-core training (HorizonStrategy(state_store=...)) in a memory budget, against the model in RAM.

    python recipes/bench_out_of_core.py                            # 16 x 768 GPT, batches 1,4,8 x 256 tokens, fp32
    python recipes/bench_out_of_core.py --ratio 3 --prefetch read --batches 8 --rounds 2
    python recipes/bench_out_of_core.py --smoke                    # CI: a tiny GPT, 2 runs

The model is the recipes' GPTPretrain (recipes/pretrain_gpt.py: AdamW, same seed, same data: the byte corpus of
recipes/lm_data.py), one rank on every core. Its training state (weights, gradients, optimizer state and masters:
lightning_horizon.memory.estimate.bytes_per_param, 16 bytes per parameter for fp32 AdamW) divided by ``--ratio``
(default 2) is the memory budget of the out-of-core arms (``--budget`` sets it instead). The default GPT, 16 x 768
with 12 heads (113M parameters: a training state of 1.7 GiB, a budget of 0.85 GiB, ~2.5x a bare Lightning
process), is recipes/configs/125m.yaml's width with 4 more layers. The arms:

- ``ram``: ``HorizonStrategy()``: the training state in RAM, no budget, no limit.
- ``store-<prefetch>`` for each ``--prefetch`` (default ``read,readahead``): ``HorizonStrategy(state_store=
  StoreConfig(path=<a fresh folder under --store-dir>, prefetch=..., probe_bytes=--probe-bytes[, readers=--readers]
  [, step=--step]), sharding=ShardingConfig(budget=BUDGET))``: weights, gradients and optimizer state in
  memory-mapped files, streamed layer by layer, and activation recompute planned to fit the same whole-process
  budget. Nothing here needs the whole gradient before the step, so ``step="auto"`` (the default) steps each layer
  in backward; ``--step after_backward`` measures the other schedule (each run's line says which ran). As root with a
  writable memory cgroup the budget is enforced: the run goes into a fresh child cgroup whose memory limit is the
  budget (v1 ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes``; v2 ``memory.max``, no swap); the
  page cache of the store's files is charged there too. Otherwise the budget is checked against the measured peak
  RSS only. ``--plan-budget`` (a diagnostic) has the sharder plan for another figure than the budget, or turns
  sharding off, the limit staying at the budget.

Every arm runs with the allocator settings of ``--malloc``: by default ``tuned``, the GLIBC_TUNABLES that
lightning_horizon's sharding recommends for RSS that follows the live tensors (``glibc``: the defaults, whose
rising mmap threshold keeps freed blocks resident). Each (arm, batch) runs in a fresh process
(lightning_horizon.layout.tuner.run_worker: its own session, killed on timeout) for ``--warmup`` + ``--steps`` optimizer
steps (the first creates the optimizer state; warm-up steps are not timed). ``--batches`` are sequences per
step, from small to the recipe's (the largest; 8, as recipes/configs/125m.yaml). Every round runs every arm at
every batch; at each batch the arms go in an order rotated from round to round, so a noisy neighbour hits them
alike. The default run, one round, takes ~10 minutes on 2 cores.

Per arm and batch:

- tokens/s: tune.StepTimer / tune.measure, the median step after the warm-up; the median over rounds, min-max
  shown; and its ratio to ``ram`` at the same batch.
- peak RSS (``VmHWM``) as a fraction of the budget. The graph sharder resets the high-water mark after each step
  (to measure the next one), so the worker takes the largest of: the mark before each step, the sharder's
  measured peak of each step, and the mark at the end. Under a cgroup (every arm gets one, the ``ram`` arm with no
  limit) also the cgroup's peak (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``: RSS plus the page cache
  the run charged, which a limit reclaims; under the limit it sits at the limit). A run the limit's OOM killer
  ends is reported with the cgroup's figures (peak, ``failcnt``, ``oom_kill``) and the kernel's lines about it;
  one killed after its last step (in fit's teardown) keeps its measurement, with that note.
- bytes read and written per step: ``trainer.strategy.store.metrics()`` (``/proc/self/io`` of the worker over one
  optimizer step), the median of the timed steps.
- achieved read bandwidth over the last step (the median over rounds): ``metrics()["read_bw"]`` (the reading
  threads' disk reads over the wall time they were reading) and ``read_bw_fraction`` (that over the read bandwidth
  the store measured at setup, ``store.disk``); split into the reads during which no write-back ran
  (``read_bw_alone_fraction``, against the same) and those that shared the disk with the step's write-back
  (``read_bw_shared_fraction``, against the read bandwidth the probe measured while writing). With
  ``prefetch="readahead"`` the threads only submit the reads (``posix_fadvise``) and the kernel completes them
  later, so their seconds undercount and the figure is no bandwidth (marked ``*``).
- final loss: the last step's loss. Same seed, same data, same arithmetic: the store arms must print the ``ram``
  arm's loss exactly ("identical"), else the difference.

The targets (printed as ratios at the recipe's batch, met or missed): identical losses, tokens/s >= 0.5x ``ram``,
peak RSS <= 1.1x the budget, achieved read bandwidth >= 0.7x the measured one (all reads against the read alone,
as the issue states it; and each kind of read against the probe made under the same conditions).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # _bench.py, gpt.py, lm_data.py, pretrain_gpt.py

from _bench import join_cgroup  # noqa: E402

join_cgroup()  # a worker joins its run's cgroup before it allocates (before torch)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from typing import Any, Optional  # noqa: E402

from _bench import cgroup_stats, cpu_line, parse_common, parse_size, probe_cgroup, run_cgroup  # noqa: E402

#: --precision: Lightning's fp32, or HorizonPrecision("bf16-true", master="fp32") (bf16 weights and gradients, fp32
#: masters); with the arguments of lightning_horizon.memory.estimate.bytes_per_param for the training state
PRECISIONS = {"32-true": ("fp32", None), "bf16-true-fp32": ("bf16-true", "fp32")}
PREFETCH = ("read", "readahead", "none")
MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}
MIB = 2**20
TARGETS = {"tps": 0.5, "rss": 1.1, "bw": 0.7}
BW = ("read_bw", "bw_fraction", "bw_alone", "bw_shared")  # the last measured step's of each run; median over rounds
#: --malloc: every arm's allocator settings. "tuned" is what lightning_horizon's sharding log recommends (GLIBC_HINT):
#: large blocks mmapped at a fixed threshold, so that RSS follows the live tensors (glibc's default raises its
#: threshold as it frees and keeps ~200 MiB of the first optimizer step's temporaries resident here)
MALLOC = {"tuned": {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576:glibc.malloc.hugetlb=1"}, "glibc": {}}
SMOKE = dict(n_layer=2, n_head=2, n_embd=64, seq=32, batches="2", warmup=1, steps=2, rounds=1, prefetch="read",
             probe_bytes=4 * MIB, budget=2**30, max_bytes=2**20)


# ---------------------------------------------------------------------------------------------- worker side


def worker(spec: dict[str, Any], out: str) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_horizon import HorizonStrategy
    from lightning_horizon.memory import current_rss, peak_rss
    from lightning_horizon.precision import HorizonPrecision
    from lightning_horizon.sharding import ShardingConfig
    from lightning_horizon.store import StoreConfig
    from lightning_horizon.layout import StepTimer
    from lm_data import ByteCorpusDataModule
    from pretrain_gpt import GPTPretrain

    class Probe(Callback):
        """Each step's loss, store metrics and RSS peak; the run's peak RSS; to ``out`` at the end of fit (JSON)."""

        def __init__(self, base: int) -> None:
            self.base, self.steps, self.disk, self.peak = base, [], None, 0

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            self.peak = max(self.peak, peak_rss())  # before the first step: setup's peak (the sharder resets it)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *_: Any) -> None:
            sharder, store = trainer.strategy.sharder, trainer.strategy.store
            step_peak = sharder.last_peak if sharder is not None and sharder.last_peak else peak_rss()
            self.peak = max(self.peak, step_peak)
            if store is not None:
                self.disk = store.disk
            self.steps.append({"loss": float(outputs["loss"]), "peak": step_peak,
                               **(store.metrics() if store is not None else {}),
                               **({"in_backward": store.in_backward} if store is not None else {})})

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.peak = max(self.peak, peak_rss())
            Path(out).write_text(json.dumps({"base": self.base, "peak": self.peak, "disk": self.disk,
                                             "steps": self.steps}))

    L.seed_everything(1337, verbose=False)
    mode, master = PRECISIONS[spec["precision"]]
    precision = {"precision": "32-true"} if master is None else {"plugins": [HorizonPrecision(mode, master=master)]}
    kw: dict[str, Any] = {}
    if spec["prefetch"]:
        kw = {"state_store": StoreConfig(path=spec["store"], prefetch=spec["prefetch"],
                                         probe_bytes=spec["probe_bytes"],
                                         **{k: spec[k] for k in ("readers", "step") if spec[k]})}
        if spec["plan_budget"]:
            kw["sharding"] = ShardingConfig(budget=spec["plan_budget"])
    probe = Probe(current_rss())  # the bare process: interpreter, torch, Lightning
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=spec["steps"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=HorizonStrategy(threads_per_rank=spec["threads"], **kw), callbacks=[StepTimer(), probe],
        **precision)
    if spec.get("declare") == "meta" and spec["prefetch"]:  # declared on the meta device: the store builds it
        with trainer.init_module(empty_init=True):
            model = GPTPretrain(**spec["model"])
    else:
        model = GPTPretrain(**spec["model"])
    trainer.fit(model, ByteCorpusDataModule(**spec["data"]))


# ---------------------------------------------------------------------------------------------- driver side


def filesystem(path: Path) -> tuple[str, str, str]:
    """(mount point, file system type, device) of the file system holding ``path``."""
    real, best = os.path.realpath(path), ("/", "?", "?")
    for line in Path("/proc/self/mounts").read_text().splitlines():
        dev, mnt, fstype = line.split()[:3]
        mnt = mnt.replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
            best = (mnt, fstype, dev)
    return best


def store_root(requested: Optional[str]) -> Path:
    """The folder the store arms' folders go in: ``--store-dir``, else the system's temporary folder or, where that
    is in memory (tmpfs: a store there would measure nothing), the project's."""
    if requested:
        return Path(requested)
    tmp = Path(tempfile.gettempdir())
    return tmp if filesystem(tmp)[1] not in MEMORY_FS else HERE.parent


def make_swap(path: Path, nbytes: int) -> None:
    """A swap file of ``nbytes`` at ``path``, switched on (root): the swap a user would try instead of the store."""
    subprocess.run(["fallocate", "-l", str(nbytes), str(path)], check=True)
    os.chmod(path, 0o600)
    subprocess.run(["mkswap", str(path)], check=True, capture_output=True)
    subprocess.run(["swapon", str(path)], check=True)
    print(f"swap: {nbytes / 2**30:,.1f} GiB at {path} (on)", flush=True)


def drop_swap(path: Path) -> None:
    """Switch the swap file off and remove it, whatever state it is in."""
    if path.exists():
        subprocess.run(["swapoff", str(path)], check=False, capture_output=True)
        path.unlink()
        print(f"swap: {path} off and removed", flush=True)


def kernel_log() -> list[str]:
    """The kernel's log lines (dmesg, timestamped; empty where it cannot be read)."""
    try:
        return subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return []


def run_arm(arm: str, batch: int, a: argparse.Namespace, budget: int, root: Path, tmp: Path) -> dict[str, Any]:
    """One arm at one batch in a fresh process: its figures, or ``{"ok": False, "note": ...}``."""
    from lightning_horizon.layout import Layout
    from lightning_horizon.layout.timer import OUT_ENV, WARMUP_ENV
    from lightning_horizon.layout.tuner import clean_env, measure, run_worker

    prefetch = arm.removeprefix("store-") if arm.startswith("store-") else None
    threads = len(os.sched_getaffinity(0))
    run_id = uuid.uuid4().hex[:12]
    folder = root / f"{arm}-b{batch}-{run_id}"
    spec = {"prefetch": prefetch, "store": str(folder), "probe_bytes": a.probe_bytes, "readers": a.readers,
            "declare": a.declare,
            "step": a.step, "plan_budget": a.plan_budget,
            "threads": threads, "precision": a.precision, "steps": a.warmup + a.steps,
            "model": {"n_layer": a.n_layer, "n_head": a.n_head, "n_embd": a.n_embd, "block_size": a.seq},
            "data": {"seq_len": a.seq, "batch_size": batch, "max_bytes": a.max_bytes, "cache_dir": a.cache_dir}}
    out = tmp / run_id
    env = clean_env()  # a clean shell, as tune's workers
    env.pop("GLIBC_TUNABLES", None)
    env.update({OUT_ENV: f"{out}.timer.json", WARMUP_ENV: str(a.warmup), **MALLOC[a.malloc]})
    if arm == "swap":  # what a user with a swap file tells the memory check: the limit and the swap count
        env["HORIZON_AVAILABLE_MEMORY"] = str(budget + a.swap_bytes)
    try:
        # the ram arm: no limit but --ram-limit (a guard for the machine); swap: the budget and swap beyond it
        limit = (budget if (prefetch or arm == "swap") and a.enforce else a.ram_limit if arm == "ram" else None)
        with run_cgroup(env, "bench_ooc", limit, swap=a.swap_bytes if arm == "swap" else 0) as cg:
            before = set(kernel_log()) if cg and cg.limit else set()
            t0 = time.perf_counter()
            rc, log = run_worker([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec),
                                  "--out", f"{out}.json"], env, a.timeout)
            cgroup = cgroup_stats(cg) if cg else None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    wall = time.perf_counter() - t0
    where = ""
    if cgroup and cg.limit:
        where = (f" | cgroup: limit {cg.limit / MIB:,.0f} MiB, peak {cgroup['peak'] / MIB:,.0f} MiB, failcnt"
                 f" {cgroup['failcnt']}" + (f", oom_kill {cgroup['oom_kill']}" if "oom_kill" in cgroup else ""))
    elif cgroup:
        where = f" | cgroup peak {cgroup['peak'] / MIB:,.0f} MiB (no limit)"
    kernel = [line for line in kernel_log() if line not in before and any(w in line.lower() for w in
                                                                             ("oom", "killed process"))] if rc else []
    if not Path(f"{out}.json").exists() or not Path(f"{out}.timer.json").exists():
        # the exception's own line where there is one (a rank's traceback ends with it), else the log's tail
        errors = [line.removeprefix("[rank0]: ").strip() for line in log.splitlines()
                  if re.match(r"(\[rank0\]: )?[\w.]+(Error|Exception|Interrupt)\b", line)]
        tail = errors[-1][:600] if errors else (" / ".join(line.strip() for line in log.strip().splitlines()[-4:])
                                                 or "no output")[-400:]
        return {"ok": False, "note": f"exit {rc} after {wall:.0f} s: {tail}{where}", "log": log,
                "kernel": kernel[-12:], "wall": wall}
    res = measure(json.loads(Path(f"{out}.timer.json").read_text()), Layout(1, threads), a.warmup)
    rep = json.loads(Path(f"{out}.json").read_text())
    timed = rep["steps"][a.warmup:] or rep["steps"][-1:]
    last = rep["steps"][-1]
    note = res.note
    if rc != 0:  # the reports are written at the end of fit's last step: a failure after it leaves them whole
        note = "; ".join(filter(None, [note, f"exit {rc} after the measured steps (fit's teardown or later){where}"]))

    def median(key: str) -> Optional[float]:
        values = [s[key] for s in timed if key in s]
        return statistics.median(values) if values else None

    return {"ok": res.status == "ok", "note": note, "tps": res.throughput, "rss": rep["peak"],
            "base": rep["base"], "cgroup": cgroup, "limit": cg.limit if cg else None, "loss": last["loss"],
            "read": median("bytes_read"), "written": median("bytes_written"), "read_bw": last.get("read_bw"),
            "bw_fraction": last.get("read_bw_fraction"), "bw_alone": last.get("read_bw_alone_fraction"),
            "bw_shared": last.get("read_bw_shared_fraction"), "in_backward": last.get("in_backward"),
            "disk": rep["disk"], "foreign": res.foreign,
            "wall": wall, "threads": threads, "exit": rc, "kernel": kernel[-12:], "log": log if rc else ""}


def _ratio(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def model_size(a: argparse.Namespace) -> tuple[int, int]:
    """(parameters, training state bytes) of the GPT: weights, gradients, masters and optimizer state."""
    import torch

    from lightning_horizon.memory.estimate import bytes_per_param
    from pretrain_gpt import GPTPretrain

    with torch.device("meta"):
        module = GPTPretrain(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.seq)
    n = sum(p.numel() for p in module.parameters())
    mode, master = PRECISIONS[a.precision]
    return n, n * bytes_per_param(mode, master)["total"]


def _x(num: Optional[float], den: Optional[float]) -> str:
    return f"{num / den:.2f}x" if num is not None and den else "-"


def _mib(n: Optional[float], digits: int = 0) -> str:
    return f"{n / MIB:,.{digits}f}" if n is not None else "-"


def _loss_vs(row: dict[str, Any], base: Optional[dict[str, Any]]) -> str:
    if base is None or row is base:
        return ""
    if row["losses"] == base["losses"] and len(row["losses"]) == 1:
        return "identical"
    return f"{row['loss'] - base['loss']:+.3g}" if len(row["losses"]) == 1 else "varies across rounds"


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", default="32-true", choices=list(PRECISIONS))
    p.add_argument("--prefetch", default="read,readahead", help=f"store arms, comma-separated, of {PREFETCH}")
    p.add_argument("--config", default=None, help="a recipe config (recipes/configs/*.yaml): its model's n_layer,"
                                                    " n_head and n_embd (the sequence stays --seq)")
    p.add_argument("--declare", choices=("init", "meta"), default="init",
                   help="the store arms' model: built by its __init__ ('init') or declared on the meta device under"
                        " trainer.init_module(empty_init=True) and built layer by layer into the store ('meta')")
    p.add_argument("--swap", default=None, help="SIZE: add the 'swap' arm, the model in RAM under the budget's limit"
                                                " with a swap file of SIZE (made in --store-dir with fallocate, mkswap,"
                                                " swapon; swapoff and removed afterwards; root)")
    p.add_argument("--ram-limit", type=parse_size, default=None,
                   help="a memory limit for the ram arm too (a guard for a shared machine: it fails instead)")
    p.add_argument("--arms", default=None, help="the arms to run, comma-separated (default: ram, the store arms,"
                                                " swap with --swap)")
    p.add_argument("--n-layer", type=int, default=16)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (and the model's block size)")
    p.add_argument("--batches", default="1,4,8", help="sequences per step, comma-separated; the largest is the"
                                                        " recipe's")
    p.add_argument("--ratio", type=float, default=2.0, help="budget = training state / RATIO")
    p.add_argument("--budget", type=parse_size, default=None, help="e.g. 800MiB: the budget itself (not --ratio)")
    p.add_argument("--plan-budget", default="budget",
                   help="what the store arms' graph sharder plans for: 'budget' (the budget), a SIZE, or 'off' (no"
                        " sharding); a diagnostic: the cgroup limit stays at the budget")
    p.add_argument("--no-limit", dest="enforce", action="store_false",
                   help="no cgroup memory limit: check the budget against the measured peak only")
    p.add_argument("--malloc", default="tuned", choices=list(MALLOC),
                   help="every arm's allocator: 'tuned' (GLIBC_TUNABLES=" + MALLOC["tuned"]["GLIBC_TUNABLES"]
                        + ", as the sharding log recommends) or 'glibc' (its defaults)")
    p.add_argument("--store-dir", default=None, help="where the store arms' folders go (on a disk, not tmpfs;"
                                                     " default: the temporary folder)")
    p.add_argument("--probe-bytes", type=parse_size, default=128 * MIB, help="StoreConfig.probe_bytes")
    p.add_argument("--readers", type=int, default=None, help="StoreConfig.readers (default: StoreConfig's)")
    p.add_argument("--step", choices=("auto", "in_backward", "after_backward"), default=None,
                   help="StoreConfig.step (default: StoreConfig's)")
    p.add_argument("--warmup", type=int, default=1, help="steps before measuring (the first creates the state)")
    p.add_argument("--steps", type=int, default=2, help="measured steps per run")
    p.add_argument("--rounds", type=int, default=1)
    a = parse_common(p, argv, SMOKE, worker)
    if a is None:  # this process was a worker
        return {}
    if a.config:
        import yaml

        model = yaml.safe_load(Path(a.config).read_text()).get("model", {})
        a.n_layer, a.n_head, a.n_embd = (model.get(k, getattr(a, k)) for k in ("n_layer", "n_head", "n_embd"))
    batches = sorted({int(b) for b in a.batches.split(",") if b.strip()})
    prefetch = [s.strip() for s in a.prefetch.split(",") if s.strip()]
    if not batches or min(batches) < 1 or a.warmup < 1 or a.steps < 1 or a.rounds < 1 or not a.ratio > 0 \
            or a.n_embd % a.n_head or not prefetch or set(prefetch) - set(PREFETCH):
        p.error(f"need --batches >= 1, --warmup/--steps/--rounds >= 1, --ratio > 0, --n-head dividing --n-embd"
                f" and --prefetch of {PREFETCH}")
    from lm_data import ByteCorpusDataModule

    params, state = model_size(a)
    budget = a.budget or int(state / a.ratio)
    plan = a.plan_budget.strip().lower()
    try:
        a.plan_budget = budget if plan == "budget" else None if plan == "off" else parse_size(plan)
    except argparse.ArgumentTypeError as e:
        p.error(f"--plan-budget: {e}")
    root_base = store_root(a.store_dir)
    mount, fstype, device = filesystem(root_base)
    if fstype in MEMORY_FS:
        if not a.smoke:
            p.error(f"the store's folder {root_base} is on {fstype} (memory): pass --store-dir on a disk")
        print(f"warning: the store's folder {root_base} is on {fstype} (memory): no disk is measured",
              file=sys.stderr)
    cg = probe_cgroup("bench_ooc", budget) if a.enforce else None
    method = (f"enforced: a fresh child cgroup per run, memory limit = the budget (cgroup {cg.method} for its"
              " peak; the ram arm: a cgroup with no limit)" if cg else
              "not enforced (" + ("--no-limit" if not a.enforce else "not root or no writable memory cgroup")
              + "): checked against the measured peak RSS")
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    arms = ["ram"] + [f"store-{s}" for s in prefetch] + (["swap"] if a.swap else [])
    if a.arms:
        arms = [x.strip() for x in a.arms.split(",") if x.strip()]
        if set(arms) - {"ram", "swap", *(f"store-{s}" for s in PREFETCH)} or ("swap" in arms and not a.swap):
            p.error(f"--arms: of ram, swap (with --swap) and store-<prefetch>, given {a.arms}")
    a.swap_bytes = parse_size(a.swap) if a.swap else 0
    print(f"bench_out_of_core: GPT {a.n_layer} layers x {a.n_embd} ({params / 1e6:.2f}M params), {a.n_head} heads |"
          f" {a.precision} | AdamW | batches {','.join(map(str, batches))} x {a.seq} tokens (the recipe's:"
          f" {max(batches)}) | arms {', '.join(arms)} | {a.warmup} warm-up + {a.steps} measured steps |"
          f" {a.rounds} round(s) | {started}", flush=True)
    print(cpu_line() + f" | malloc: {a.malloc}"
          f" {' '.join(f'{k}={v}' for k, v in MALLOC[a.malloc].items()) or '(defaults)'}", flush=True)
    planned = ("the budget" if a.plan_budget == budget else "off" if a.plan_budget is None
               else f"{a.plan_budget / MIB:,.0f} MiB (--plan-budget)")
    print(f"training state {state / MIB:,.0f} MiB ({state / params:.0f} bytes/param) | budget {budget / MIB:,.0f} MiB"
          f" ({'--budget' if a.budget else f'state / {a.ratio:g}'}) | budget {method} | store arms' sharding"
          f" plans for: {planned}", flush=True)
    print(f"store: under {root_base} on {device} ({fstype}, mounted at {mount},"
          f" {shutil.disk_usage(root_base).free / 2**30:,.1f} GiB free) | probe {a.probe_bytes / MIB:,.0f} MiB",
          flush=True)
    ByteCorpusDataModule(max_bytes=a.max_bytes, cache_dir=a.cache_dir).prepare_data()  # the token cache, once
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {(b, s): [] for b in batches for s in arms}
    failed: list[dict[str, Any]] = []
    root = Path(tempfile.mkdtemp(prefix="bench_out_of_core_", dir=root_base))
    swapfile = root / "swapfile" if "swap" in arms else None
    try:
        if swapfile is not None:
            make_swap(swapfile, a.swap_bytes)
        with tempfile.TemporaryDirectory(prefix="bench_out_of_core_") as tmp:
            for rnd in range(a.rounds):
                for i, b in enumerate(batches):
                    k = (rnd + i) % len(arms)
                    for s in arms[k:] + arms[:k]:  # rotated: no arm always first
                        res = run_arm(s, b, a, budget, root, Path(tmp))
                        if not res["ok"]:
                            failed.append({"arm": s, "batch": b, "round": rnd + 1, **res})
                            print(f"  round {rnd + 1}: batch {b} {s:<15} FAILED: {res['note']}", flush=True)
                            for line in res.get("kernel", []):
                                print(f"    kernel: {line}", flush=True)
                            continue
                        runs[(b, s)].append(res)
                        if res["exit"]:
                            failed.append({"arm": s, "batch": b, "round": rnd + 1, **res})
                        cgp = res["cgroup"]["peak"] if res["cgroup"] else None
                        print(f"  round {rnd + 1}: batch {b} {s:<15} {res['tps']:>8,.0f} tok/s  peak RSS"
                              f" {_mib(res['rss'])} MiB ({_x(res['rss'], budget)} budget)  cgroup peak"
                              f" {_mib(cgp)} MiB  read {_mib(res['read'], 1)} / written {_mib(res['written'], 1)}"
                              f" MiB/step  loss {res['loss']:.6f}  others' load {100 * res['foreign']:.0f}%"
                              + ("" if res["in_backward"] is None else
                                 f"  step {'in' if res['in_backward'] else 'after'} backward")
                              + ("" if res["bw_fraction"] is None else
                                 f"  read bw {res['read_bw'] / 1e6:,.0f} MB/s = {res['bw_fraction']:.2f} of the probe"
                                 f" (alone {_ratio(res['bw_alone'])}, shared {_ratio(res['bw_shared'])})")
                              + f"  ({res['wall']:.0f} s)" + (f"  note: {res['note']}" if res["note"] else ""),
                              flush=True)
                        for line in res["kernel"]:
                            print(f"    kernel: {line}", flush=True)
    finally:
        if swapfile is not None:
            drop_swap(swapfile)
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for (b, s), rs in runs.items():
        if not rs:
            rows.append({"batch": b, "arm": s, "ok": False})
            continue
        tps = [x["tps"] for x in rs]
        peaks = [x["cgroup"]["peak"] for x in rs if x["cgroup"]]
        bws = {k: statistics.median(v) for k in BW if (v := [x[k] for x in rs if x.get(k) is not None])}
        rows.append({**rs[-1], **{k: None for k in BW}, **bws, "batch": b, "arm": s, "tps": statistics.median(tps),
                     "min": min(tps),
                     "max": max(tps), "rss": max(x["rss"] for x in rs), "foreign": max(x["foreign"] for x in rs),
                     "cgroup_peak": max(peaks) if peaks else None,
                     "oom_kill": sum(x["cgroup"].get("oom_kill", 0) for x in rs if x["cgroup"]),
                     "losses": sorted({x["loss"] for x in rs})})
    header = ("| batch x seq | arm | tokens/s (min-max) | vs ram | peak RSS MiB | / budget | cgroup peak MiB |"
              " / budget | read MiB/step | written MiB/step | read bw MB/s | / measured | alone / measured |"
              " shared / measured while writing | others' load | final loss |"
              " vs ram |")
    print("\n" + header + "\n|" + "|".join("---" for _ in header.split("|")[1:-1]) + "|")
    for row in rows:
        if not row["ok"]:
            print(f"| {row['batch']} x {a.seq} | {row['arm']} | failed (below) |" + " |" * 14)
            continue
        base = next((x for x in rows if x["batch"] == row["batch"] and x["arm"] == "ram" and x["ok"]), None)
        star = "*" if row["arm"] == "store-readahead" and row["read_bw"] is not None else ""
        bw = f"{row['read_bw'] / 1e6:,.0f}{star}" if row["read_bw"] is not None else "-"
        bwf, alone, shared = (f"{row[k]:.2f}{star}" if row.get(k) is not None else "-"
                              for k in ("bw_fraction", "bw_alone", "bw_shared"))
        loss = ", ".join(f"{v:.6f}" for v in row["losses"])
        print(f"| {row['batch']} x {a.seq} | {row['arm']} | {row['tps']:,.0f} ({row['min']:,.0f}-{row['max']:,.0f}) |"
              f" {_x(row['tps'], base['tps'] if base else None)} | {_mib(row['rss'])} | {_x(row['rss'], budget)} |"
              f" {_mib(row['cgroup_peak'])} | {_x(row['cgroup_peak'], budget)} | {_mib(row['read'], 1)} |"
              f" {_mib(row['written'], 1)} | {bw} | {bwf} | {alone} | {shared} | {100 * row['foreign']:.0f}% |"
              f" {loss} |"
              f" {_loss_vs(row, base)} |")
    ok = [r for r in rows if r["ok"]]
    disk = next((r["disk"] for r in ok if r.get("disk")), None)
    if disk:
        print(f"disk measured at setup (the store's probe, {a.probe_bytes / MIB:,.0f} MiB): read {disk[0] / 1e6:,.0f}"
              f" MB/s ({disk[2] / 1e6:,.0f} MB/s while writing), write {disk[1] / 1e6:,.0f} MB/s; 'alone': the reads"
              " during which no write-back ran, 'shared': those that shared the disk with one (against the read"
              " measured while writing)")
    if ok:
        kills = ", ".join(f"{r['arm']}@{r['batch']} {r['oom_kill']}" for r in ok if r["limit"]) or "-"
        print(f"bare process (RSS before the model is built): {_mib(min(r['base'] for r in ok))} MiB;"
              f" OOM kills in the limited cgroups (after the measured steps): {kills}")
    if any(r["arm"] == "store-readahead" for r in ok):
        print("* readahead: the prefetch thread only submits the reads (posix_fadvise WILLNEED) and the kernel"
              " completes them later: bytes over submission seconds, no bandwidth")
    top = max(batches)
    ram = next((r for r in ok if r["batch"] == top and r["arm"] == "ram"), None)
    print(f"\ntargets at the recipe's batch ({top} x {a.seq} tokens), budget {budget / MIB:,.0f} MiB:")
    for s in arms[1:]:
        row = next((r for r in ok if r["batch"] == top and r["arm"] == s), None)
        if row is None or ram is None:
            print(f"  {s}: no result ({'this arm' if row is None else 'ram'} failed)")
            continue
        checks = [
            ("final loss identical to ram", _loss_vs(row, ram) == "identical",
             f"{', '.join(map(repr, row['losses']))} vs {', '.join(map(repr, ram['losses']))}"),
            (f"tokens/s >= {TARGETS['tps']}x ram", row["tps"] >= TARGETS["tps"] * ram["tps"],
             f"{row['tps'] / ram['tps']:.2f}x"),
            (f"peak RSS <= {TARGETS['rss']}x budget", row["rss"] <= TARGETS["rss"] * budget,
             f"{row['rss'] / budget:.2f}x" + (f" (cgroup peak {row['cgroup_peak'] / budget:.2f}x)"
                                              if row["cgroup_peak"] else "")),
            (f"read bandwidth >= {TARGETS['bw']}x measured", (row["bw_fraction"] or 0) >= TARGETS["bw"],
             f"{row['bw_fraction']:.2f}x{'*' if s == 'store-readahead' else ''}" if row["bw_fraction"] is not None
             else "not measured"),
        ] + [(f"{what} >= {TARGETS['bw']}x {against}", (row[k] or 0) >= TARGETS["bw"],
              f"{row[k]:.2f}x{'*' if s == 'store-readahead' else ''}" if row[k] is not None else "not measured")
             for k, what, against in (("bw_alone", "reads with no write-back running", "measured"),
                                      ("bw_shared", "reads during a write-back", "measured while writing"))]
        for name, met, value in checks:
            print(f"  {s}: {name}: {value} -> {'met' if met else 'MISSED'}")
    if failed:
        print(f"\nruns that exited with an error ({len(failed)}):")
        for f in failed:
            print(f"  round {f['round']}: {f['arm']} at batch {f['batch']}"
                  f"{' (measured before it)' if f['ok'] else ''}: {f['note']}")
    finished = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"{started} .. {finished}")
    result = {"method": method, "params": params, "state": state, "budget": budget,
              "rows": [{k: v for k, v in r.items() if k != "log"} for r in rows],
              "failed": [{k: v for k, v in f.items() if k != "log"} for f in failed], "started": started,
              "finished": finished, "args": {k: v for k, v in vars(a).items() if k not in ("worker", "out")}}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if failed:
        f = failed[0]
        print(f"\n{len(failed)} run(s) exited with an error; the first ({f['arm']} at batch {f['batch']}), its log's"
              f" tail:\n{f['log'][-3000:]}", file=sys.stderr)
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
