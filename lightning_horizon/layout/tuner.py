"""The layout tuner: time a few optimizer steps of the real training under each candidate layout, keep the fastest.

The command line is ``python -m lightning_horizon.tune`` (lightning_horizon/tune.py).

The script is a LightningCLI program training with HorizonStrategy (``--trainer.strategy.threads_per_rank``)
whose datamodule takes the per-rank batch as ``--data.batch_size`` (``--batch-arg`` names another); with
subcommands (``fit`` runs) or ``LightningCLI(run=False)`` (the script calls ``fit`` itself). Before anything runs,
the tuner reads the script's configuration with the user's arguments (``--print_config``) and refuses, naming
what it needs, a script that is not such a program, trains with another strategy or has no batch option; a
strategy given by name (``horizon``) is passed on as its class path. For each
layout ``R x T`` (:func:`lightning_horizon.layout.candidates`, or ``--layouts``) the tuner starts the script's
``fit`` in a fresh process group with ``--trainer.devices R --trainer.strategy.threads_per_rank T``, the global
batch split over the R ranks, ``--warmup + --steps`` steps and no validation; Lightning's launcher starts the
other ranks, as it would for the real run. The :class:`StepTimer` callback, added with ``--trainer.callbacks+=``,
writes rank 0's step-end times and every rank's peak RSS (``VmHWM``). A layout's speed is the median of its
measured steps; the winner is the fastest, or, within ``--tolerance`` of it, the one with fewest ranks (each rank
replicates the model). A layout whose memory, predicted from the most-ranked layout measured before it (per-rank
peak x ranks), exceeds the node's free memory is refused, and a failed run is reported, not fatal (when none ran,
the tuner exits 1 with each one's failure; a bad flag, a missing script or a script of another shape exits 2
before any layout runs). The winner is
cached (cache.py) under the workload the worker reports, where the script's automatic layout finds it
(recipes/pretrain_gpt.py), and the table shows what the rule (layout.rule_layout) would have taken instead.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from lightning_horizon.checks import is_int, is_number, require
from lightning_horizon.layout import cache as layout_cache
from lightning_horizon.layout.rule import Layout
from lightning_horizon.layout.timer import OUT_ENV, WARMUP_ENV
from lightning_horizon.memory.probe import node_free_memory

#: what a launcher (Lightning's, torchrun) leaves in a process's environment, also after an in-process fit: a
#: process started with them believes it is a launched rank and waits for peers that never come
LAUNCHER_VARS = frozenset({"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GLOBAL_RANK", "RANK",
                           "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "PL_GLOBAL_SEED", "PL_SEED_WORKERS",
                           "TORCHELASTIC_RUN_ID"})
# a worker starts as from a clean shell: no launcher state, no thread counts, no layout an outer run chose
_DROPPED_VARS = LAUNCHER_VARS | {"OMP_NUM_THREADS", "MKL_NUM_THREADS", layout_cache.CHOSEN_ENV}


def clean_env() -> dict[str, str]:
    """This process's environment as a worker starts with it: as from a clean shell (no launcher state, no thread
    counts, no layout an outer run chose)."""
    return {k: v for k, v in os.environ.items() if k not in _DROPPED_VARS}


#: what each of the tuner's numeric settings allows: tune() and select() check their arguments against it, and the
#: command line its flags, before anything runs
ALLOWED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "warmup": (lambda v: is_int(v, 1), "an int >= 1"),
    "steps": (lambda v: is_int(v, 2), "an int >= 2"),
    "retries": (lambda v: is_int(v, 0), "an int >= 0"),
    "timeout": (lambda v: is_number(v, 0), "a finite number of seconds > 0"),
    "max_foreign": (lambda v: is_number(v, 0, 1, include_low=True, include_high=True), "a share in [0, 1]"),
    "tolerance": (lambda v: is_number(v, 0, 1, include_low=True), "a number in [0, 1)"),
    "global_batch": (lambda v: is_int(v, 1), "an int >= 1"),
}

def _check(owner: str, name: str, value: Any) -> None:
    ok, allowed = ALLOWED[name]
    require(ok(value), owner, name, value, allowed)


@dataclass
class Result:
    """One candidate's outcome: ``status`` is ``"ok"``, ``"refused"`` (memory), ``"skipped"`` or ``"failed"``."""

    layout: Layout
    status: str
    throughput: float = 0.0
    """global samples (or tokens, when the batch has a sequence axis) per second: median step"""
    unit: str = "samples/s"
    step_s: float = 0.0
    peak_rss: list[int] = field(default_factory=list)
    """bytes per rank"""
    foreign: float = 0.0
    """share of the machine's CPU time other processes took while this layout was measured"""
    note: str = ""
    report: dict[str, Any] = field(default_factory=dict)
    """the worker's JSON"""


def select(results: Sequence[Result], tolerance: float = 0.03) -> Optional[Result]:
    """The fastest ``ok`` result; any within ``tolerance`` of it with fewer ranks wins instead (less memory). None
    when nothing ran."""
    _check("select", "tolerance", tolerance)
    ok = [r for r in results if r.status == "ok"]
    if not ok:
        return None
    best = max(r.throughput for r in ok)
    return min((r for r in ok if r.throughput >= best * (1 - tolerance)),
               key=lambda r: (r.layout.ranks, -r.throughput))


def predict_memory(layout: Layout, results: Sequence[Result]) -> Optional[int]:
    """Bytes ``layout`` will hold on the node: the per-rank peak of the most-ranked layout measured with fewer
    ranks, times ``layout.ranks`` (an upper bound: a rank's share of the batch, and so of the activations,
    shrinks as ranks grow). None when nothing with fewer ranks was measured."""
    before = [r for r in results if r.status == "ok" and r.layout.ranks < layout.ranks and r.peak_rss]
    if not before:
        return None
    ref = max(before, key=lambda r: r.layout.ranks)
    return max(ref.peak_rss) * layout.ranks


def run_worker(cmd: Sequence[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run ``cmd`` in its own process group; kill the group on timeout and at the end (ranks left behind)."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        return -9, f"{log}\ntimed out after {timeout:.0f} s"  # last: callers show the log's tail
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return proc.returncode, log


def measure(report: dict[str, Any], layout: Layout, warmup: int) -> Result:
    """A Result from a worker's JSON: the median of the step intervals after ``warmup`` steps."""
    ends = report["ends"]
    intervals = [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])]
    if not intervals:
        return Result(layout, "failed", note=f"{len(ends)} steps ran, fewer than warmup + 1", report=report)
    step = statistics.median(intervals)
    wl = report["workload"]
    per_step, unit = wl["global_batch"] * (wl["seq_len"] or 1), "tokens/s" if wl["seq_len"] else "samples/s"
    got = Layout(report["ranks"], report["threads"])
    note = "" if got == layout else f"ran as {got}"
    return Result(layout, "ok", per_step / step, unit, step, list(report["peak_rss"]), report.get("foreign", 0.0),
                  note, report)


def tune(
    command: Callable[[Layout, Optional[int], Path], list[str]],
    layouts: Sequence[Layout],
    *,
    warmup: int = 2,
    steps: int = 5,
    timeout: float = 600,
    retries: int = 1,
    max_foreign: float = 0.10,
    global_batch: Optional[int] = None,
    free_memory: Callable[[], int] = node_free_memory,
    progress: Callable[[str], None] = print,
) -> list[Result]:
    """Run every layout, fewest ranks first, each in fresh processes: ``command(layout, per_rank_batch, run_dir)``
    is the worker's command line (``per_rank_batch`` None: leave the script's own; ``run_dir``: a temporary folder
    for its files). The global batch is ``global_batch``, else learned from the 1-rank run; a layout with more ranks
    that runs before it is known keeps the script's batch per rank (``main`` then reports it as another workload).
    A layout measured while other processes took more than ``max_foreign`` of the machine runs again, up to
    ``retries`` times, and the quietest run counts."""
    given = {"warmup": warmup, "steps": steps, "retries": retries, "timeout": timeout, "max_foreign": max_foreign}
    for name, value in {**given, **({} if global_batch is None else {"global_batch": global_batch})}.items():
        _check("tune", name, value)
    results: list[Result] = []
    order = sorted(set(layouts))
    with tempfile.TemporaryDirectory(prefix="horizon_tune_") as tmp:
        for i, lay in enumerate(order, 1):
            head = f"[{i}/{len(order)}] {lay}:"
            tries = [_one(command, lay, results, warmup, steps, timeout, global_batch, free_memory, Path(tmp))]
            while tries[-1].status == "ok" and tries[-1].foreign > max_foreign and len(tries) <= retries:
                progress(f"{head} others took {100 * tries[-1].foreign:.0f}% of the machine meanwhile: again")
                tries.append(_one(command, lay, results, warmup, steps, timeout, global_batch, free_memory,
                                  Path(tmp)))
            if len(tries) > 1 and tries[-1].status != "ok":
                progress(f"{head} rerun {tries[-1].status}: {tries[-1].note}")
            res = min(tries, key=lambda r: (r.status != "ok", r.foreign))
            if res.status == "ok" and global_batch is None and lay.ranks == 1:
                global_batch = res.report["workload"]["global_batch"]
            results.append(res)
            if res.status != "ok":
                progress(f"{head} {res.status}: {res.note}")
                continue
            rss = " + ".join(f"{b / 2**20:,.0f}" for b in res.peak_rss)
            progress(f"{head} {res.throughput:,.0f} {res.unit} (median step {res.step_s * 1e3:,.1f} ms of {steps}),"
                     f" peak RSS {rss} MiB, others' load {100 * res.foreign:.0f}%"
                     + (f"; {res.note}" if res.note else ""))
    return results


def _one(command: Callable[[Layout, Optional[int], Path], list[str]], lay: Layout, done: list[Result], warmup: int,
         steps: int, timeout: float, global_batch: Optional[int], free_memory: Callable[[], int], tmp: Path) -> Result:
    if global_batch is not None and global_batch % lay.ranks:
        return Result(lay, "skipped", note=f"global batch {global_batch} does not split over {lay.ranks} ranks")
    predicted, free = predict_memory(lay, done), free_memory()
    if predicted is not None and predicted > free:
        return Result(lay, "refused", note=f"predicted {predicted / 2**30:.2f} GiB > {free / 2**30:.2f} GiB free")
    n = len(list(tmp.glob("*.json")))
    out = tmp / f"{lay.ranks}x{lay.threads}.{n}.json"
    env = clean_env()
    env.update({OUT_ENV: str(out), WARMUP_ENV: str(warmup)})
    per_rank = None if global_batch is None or lay.ranks == 1 else global_batch // lay.ranks
    t0 = time.perf_counter()
    rc, log = run_worker(command(lay, per_rank, tmp / f"{lay.ranks}x{lay.threads}.{n}"), env, timeout)
    if not out.exists():
        tail = " / ".join(line.strip() for line in log.strip().splitlines()[-3:]) or "no output"
        return Result(lay, "failed", note=f"exit {rc} after {time.perf_counter() - t0:.0f} s: {tail[-300:]}",
                      report={"log": log[-4000:]})
    res = measure(json.loads(out.read_text()), lay, warmup)
    if rc != 0:  # the report is written at the end of fit: a crash at exit leaves the measurement whole
        res.note = "; ".join(filter(None, [res.note, f"exit {rc} after the measurement"]))
    return res


def table(results: Sequence[Result], winner: Optional[Result]) -> str:
    """A markdown table of every candidate, speeds relative to the winner."""
    unit = next((r.unit for r in results if r.status == "ok"), "samples/s")
    lines = [f"| layout (ranks x threads) | {unit:>10} | vs winner | peak RSS per rank (MiB) | others' load | note |",
             "|---|---:|---:|---|---:|---|"]
    for r in results:
        if r.status == "ok":
            rel = f"{r.throughput / winner.throughput:.2f}x" if winner else "-"
            rss = ", ".join(f"{b / 2**20:,.0f}" for b in r.peak_rss)
            mark = " (winner)" if r is winner else ""
            lines.append(f"| {r.layout}{mark} | {r.throughput:>10,.0f} | {rel} | {rss} | {100 * r.foreign:.0f}% |"
                         f" {r.note} |")
        else:
            lines.append(f"| {r.layout} | - | - | - | - | {r.status}: {r.note} |")
    return "\n".join(lines)


def script_command(script: str, script_args: Sequence[str], steps: int, batch_arg: str = "data.batch_size",
                   subcommand: bool = True,
                   strategy_args: Sequence[str] = ()) -> Callable[[Layout, Optional[int], Path], list[str]]:
    """The worker command for a LightningCLI ``script``: its ``fit`` (``subcommand``; else a ``run=False`` script,
    which calls fit itself) with the layout, ``steps`` steps, no validation, its files under the run's temporary
    folder, and the :class:`StepTimer` callback; ``strategy_args`` (``script.inspect_script``) come first."""
    args = list(script_args)
    if args and args[0] == "fit":
        args = args[1:]
    head = ["fit"] if subcommand else []
    # a run=False script may test or predict after its fit: nothing to measure there
    tail = [] if subcommand else ["--trainer.limit_test_batches", "0", "--trainer.limit_predict_batches", "0"]

    def command(lay: Layout, per_rank_batch: Optional[int], run_dir: Path) -> list[str]:
        cmd = [sys.executable, script, *head, *args, *strategy_args, "--trainer.devices", str(lay.ranks),
               "--trainer.strategy.threads_per_rank", str(lay.threads), "--trainer.max_steps", str(steps),
               "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0", *tail,
               "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run_dir),
               "--trainer.callbacks+=lightning_horizon.layout.StepTimer"]
        return cmd + ([f"--{batch_arg}", str(per_rank_batch)] if per_rank_batch is not None else [])

    return command


def check_same_workload(results: Sequence[Result]) -> None:
    """Every layout must have trained the same workload (the first's): a run with another batch is not comparable."""
    ok = [r for r in results if r.status == "ok"]
    for r in ok[1:]:
        if r.report["workload"] != ok[0].report["workload"]:
            r.status, r.note = "failed", (f"trained another workload (global batch"
                                          f" {r.report['workload']['global_batch']}): pass --batch")


__all__ = ["ALLOWED", "LAUNCHER_VARS", "Result", "clean_env", "measure", "predict_memory", "run_worker", "script_command", "select",
           "table", "tune"]
