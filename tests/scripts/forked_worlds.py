"""Processes forked from a script after its imports: several worlds of ranks (or lone fits) in one launch.

A process start with ``import lightning`` costs seconds of CPU, more than the tiny fits the tests run in it. A script
that runs several worlds imports once and forks each world's ranks from itself, before it has built a model, a
tensor, a thread pool or a process group: every child is a fresh process but for the modules it shares with its
parent. ``world`` gives each rank the variables Lightning's own launcher gives the ranks it starts (MASTER_ADDR,
MASTER_PORT, NODE_RANK, LOCAL_RANK, WORLD_SIZE), so that Lightning takes the ranks as launched outside it (as under
torchrun) and starts nothing itself. The test's launch (tests/launch.py) keeps its hard timeout: its kill of the
launch's process group reaches every forked child.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence



def run_forked(bodies: Sequence[Callable[[], None]], log: Optional[Path] = None) -> list[int]:
    """Run each body in a child of its own, all at once; wait for every child and return their exit statuses (0: the
    body returned, 1: it raised (the traceback is in the output), the status a body gives ``os._exit`` itself, -N:
    killed by signal N). The children's output goes to ``log`` (appended) if given, else where this process's goes."""
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for body in bodies:
        pid = os.fork()
        if pid == 0:
            _child(body, log)
        pids.append(pid)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


def world(devices: int, body: Callable[[], None], log: Optional[Path] = None) -> list[int]:
    """Run ``body`` in each of the ``devices`` ranks of one world on this machine (one node; a free port of its own),
    and return the ranks' exit statuses (see ``run_forked``)."""
    port = _free_port()

    def rank(local_rank: int) -> None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(local_rank),
                          WORLD_SIZE=str(devices))
        body()

    return run_forked([functools.partial(rank, r) for r in range(devices)], log)


def record(out: Path, tag: str, exits: list[int], log: Path, seconds: Optional[float] = None) -> None:
    """Append ``{"tag": tag, "exit": exits, "ended_at": wall clock}`` (and ``"seconds"`` if given) to OUT/exits.jsonl
    (what the test reads), and print the job's log."""
    line = {"tag": tag, "exit": exits, "ended_at": time.time(),
            **({} if seconds is None else {"seconds": round(seconds, 3)})}
    with open(out / "exits.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    print(f"=== {tag}: exit {exits}\n{log.read_text() if log.exists() else ''}", flush=True)


def run_jobs(jobs: Sequence[dict], out: Path) -> None:
    """Run ``jobs`` one after another, each in processes forked from this one, and ``record`` each as it ends.

    A job is ``{"tag": T, "call": "module:function" or "path/to/file.py:function", "args": [...], "env": {...},
    "devices": N}``: a world of N ranks (``world``), each calling ``function(*args)`` with ``env`` added to its
    environment (e.g. OMP_NUM_THREADS: OpenMP has not started yet in a forked process); or ``{"tag": T,
    "processes": [{"call": ..., "args": ..., "env": ...}, ...]}``: those calls at once, each in a plain process of its
    own (no launcher variables). Every job's function is imported before the first fork: paid once."""
    for job in jobs:  # import everything first: no child pays for an import
        for spec in job.get("processes", [job]):
            _function(spec["call"])
    for job in jobs:
        log = out / f"{job['tag']}.log"
        start = time.monotonic()
        if "processes" in job:
            exits = run_forked([_bound(spec) for spec in job["processes"]], log)
        else:
            exits = world(job["devices"], _bound(job), log)
        record(out, job["tag"], exits, log, time.monotonic() - start)


@functools.cache
def _function(call: str) -> Callable:
    where, name = call.rsplit(":", 1)
    if where.endswith(".py"):  # a file outside the package (a test's own script)
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _bound(spec: dict) -> Callable[[], None]:
    function, args, env = _function(spec["call"]), spec.get("args", []), spec.get("env", {})

    def body() -> None:
        os.environ.update({k: str(v) for k, v in env.items()})
        function(*args)

    return body


def _free_port() -> int:
    # what Lightning's find_free_network_port does, without importing Lightning (a job may not need it)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _child(body: Callable[[], None], log: Optional[Path]) -> None:
    code = 1
    try:
        if log is not None:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        body()
        code = 0
    except SystemExit as exit:  # a body's sys.exit(n): its status, as a process's
        code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never the interpreter's exit: its atexit handlers belong to the parent


if __name__ == "__main__":  # python forked_worlds.py JOBS.json OUT_DIR: JOBS holds {"jobs": [...]} (see run_jobs)
    run_jobs(json.loads(Path(sys.argv[1]).read_text())["jobs"], Path(sys.argv[2]))
