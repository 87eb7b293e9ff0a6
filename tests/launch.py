"""Run a script in its own process group with a hard timeout, and reap every process it started.

Multi-process tests start a script (Lightning's launcher or torch.multiprocessing spawns the other ranks from
it); on timeout or failure the whole process group is killed, so a hang never outlives its test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from lightning_horizon.layout.tuner import LAUNCHER_VARS

REPO = Path(__file__).resolve().parent.parent


def run_script(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    timeout: float = 120,
    env: Optional[dict] = None,
    cwd: Optional[str | Path] = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``python script *args``; kill its whole process group on timeout; raise on a non-zero exit."""
    return run_scripts([(script, args, env)], timeout=timeout, cwd=cwd, check=check)[0]


def run_scripts(
    launches: Sequence[tuple[str | Path, Sequence[str], Optional[dict]]],
    *,
    timeout: float = 120,
    cwd: Optional[str | Path] = None,
    check: bool = True,
    prefixes: Optional[Sequence[Sequence[str]]] = None,
) -> list[subprocess.CompletedProcess]:
    """Start several ``(script, args, env)`` launches at once (e.g. one per emulated node), each in its own
    process group, wait for all under one deadline, then kill every group (whatever is left of it).

    ``prefixes`` (one per launch) go before the interpreter, e.g. ``["taskset", "-c", "0"]``.
    """
    procs = []
    for i, (script, args, env) in enumerate(launches):
        # A launch starts clean: variables a launcher left in this process (an in-process fit sets LOCAL_RANK,
        # MASTER_PORT, ...) would make the child believe it is a spawned rank and wait for peers forever.
        inherited = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        full_env = {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env.setdefault("PYTHONPATH", str(REPO))
        cmd_prefix = list(prefixes[i]) if prefixes else []
        procs.append(
            subprocess.Popen(
                [*cmd_prefix, sys.executable, str(script), *map(str, args)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=full_env,
                cwd=str(cwd or REPO),
                start_new_session=True,  # its own process group: killpg reaches every rank it launches
            )
        )
    deadline = time.monotonic() + timeout
    results, timed_out = [], False
    try:
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                for p in procs:
                    _kill_group(p.pid)
                out, _ = proc.communicate()
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, None))
    finally:
        for proc in procs:
            _kill_group(proc.pid)  # leftovers (e.g. ranks still alive after their launcher exited)
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    tails = "\n".join(f"--- {r.args[-3:]} exited {r.returncode}:\n{r.stdout[-5000:]}" for r in results)
    if timed_out:
        raise AssertionError(f"timed out after {timeout}s\n{tails}")
    if check and any(r.returncode != 0 for r in results):
        raise AssertionError(f"a launch failed\n{tails}")
    return results


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


FORKED_WORLDS = REPO / "tests" / "scripts" / "forked_worlds.py"


def run_worlds(jobs: Sequence[dict], work: Path, *, timeout: float, env: Optional[dict] = None,
               check: bool = True) -> tuple[dict[str, dict], str]:
    """Run ``jobs`` (tests/scripts/forked_worlds.py's ``run_jobs``) in one launch: one process start, each job's ranks
    forked from it after its imports, under one hard timeout. Returns ``{tag: {"exit": [status per process],
    "seconds": s, "log": text}}`` for every job that ended, and the launch's output. With ``check`` a timeout or a
    failed launch raises; without, a job missing from the answer never ended (the launch timed out in it or before
    it: the output says which)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "exits.jsonl").unlink(missing_ok=True)
    (work / "jobs.json").write_text(json.dumps({"jobs": list(jobs)}, default=str))
    try:
        output = run_script(FORKED_WORLDS, [work / "jobs.json", work], timeout=timeout, env=env, check=check).stdout
    except AssertionError as err:  # timed out (a hang): every process of the launch is gone
        if check:
            raise
        output = str(err)
    ended = {}
    if (work / "exits.jsonl").exists():
        for line in (work / "exits.jsonl").read_text().splitlines():
            job = json.loads(line)
            log = work / f"{job['tag']}.log"
            ended[job["tag"]] = {**job, "log": log.read_text() if log.exists() else ""}
    return ended, output


def assert_exited(ended: dict[str, dict], tag: str, expect: Sequence[int]) -> None:
    """The job ``tag`` of a ``run_worlds`` launch ended with these exit statuses (its log in the message if not)."""
    assert tag in ended, f"job {tag} never ended; jobs that did: {sorted(ended)}"
    assert ended[tag]["exit"] == list(expect), f"job {tag} exited {ended[tag]['exit']}:\n{ended[tag]['log'][-8000:]}"
