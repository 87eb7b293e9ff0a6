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
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

from lightning.fabric.plugins.environments.lightning import find_free_network_port


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
    port = find_free_network_port()

    def rank(local_rank: int) -> None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(local_rank),
                          WORLD_SIZE=str(devices))
        body()

    return run_forked([functools.partial(rank, r) for r in range(devices)], log)


def record(out: Path, tag: str, exits: list[int], log: Path) -> None:
    """Append ``{"tag": tag, "exit": exits}`` to OUT/exits.jsonl (what the test reads), and print the job's log."""
    with open(out / "exits.jsonl", "a") as f:
        f.write(json.dumps({"tag": tag, "exit": exits}) + "\n")
    print(f"=== {tag}: exit {exits}\n{log.read_text()}", flush=True)


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
