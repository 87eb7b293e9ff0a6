"""A heartbeat on the rendezvous store: a peer that hangs is named on every other rank and the job ends.

A peer that dies is noticed when a collective fails (liveness.py). A peer that *hangs* (stopped by SIGSTOP, swapped
out, stuck in I/O or in a long call inside ``training_step``) is noticed only at the collective's timeout, which
must be long enough for a slow checkpoint write (600 s by default), and that path names nobody. Here every
rank runs a thread that, every ``interval`` seconds, writes to the rendezvous store (a client of its own, with a
short timeout) a beat: a sequence number and the rank's progress, a count of the points the training thread has
passed (training step begun and ended, backward begun and ended, optimizer step begun and ended, a checkpoint
write, an evaluation step). Every point is passed by every rank alike, so the counts agree between ranks at
the same place of the program. Then it reads every peer's beat and names a peer

- *silent*: whose sequence number has not moved for ``timeout`` seconds (its process does not run: stopped,
  swapped out, or its host is gone), or
- *stuck*: whose progress has not moved for ``timeout`` seconds while it is behind this rank, and this rank has
  not moved either (it waits for the peer: in the gradient allreduce, in a barrier).

A rank that names a peer logs it (rank, node, host, pid, where the peer was and for how long), writes the verdict
to the store so that every rank ends with it (the hung rank too, when its own thread still runs), kills the named
ranks that run on its own host (``SIGKILL``: a stopped process cannot end itself) and ends its process with
:data:`EXIT_CODE`. A rank whose store is unreachable for ``timeout`` seconds (the host of rank 0, which serves
it, is gone) ends too. Every checkpoint write is atomic (checkpoint_io.py): the last complete checkpoint stays
on disk. Ranks on other hosts than a stopped one cannot be killed from here: their launcher (torchrun, SLURM, or
Lightning's, which ends its children when one fails) does it when the other ranks end.

What it cannot tell from a hang: work one rank does alone for longer than ``timeout`` while the others wait (rank
0 evaluating in ``on_train_epoch_end`` while the others wait in the next step's allreduce). Give such a job a longer
``heartbeat_timeout``, or ``None`` to switch the heartbeat off.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from lightning_horizon import liveness
from lightning_horizon import placement as _placement

log = logging.getLogger("lightning_horizon.strategy")  # the strategy's log: where its user looks

#: the exit status of a rank that ends because a peer hung (EX_TEMPFAIL: try again, e.g. resume from the checkpoint)
EXIT_CODE = 75
#: the default ``heartbeat_timeout`` in seconds
DEFAULT_TIMEOUT_S = 30.0
PREFIX = "horizon/heartbeat/"
VERDICT = PREFIX + "verdict"


def connect(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the rendezvous store at ``address:port`` of its own, whose calls give up after ``timeout_s``."""
    return dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def start(address: str, port: int, rank: int, placement: list[dict[str, Any]],
          timeout_s: float) -> Optional["Heartbeat"]:
    """This rank's heartbeat on the rendezvous store at ``address:port``, started; ``None``, with a warning, where
    no store answers there (a process group started without one, e.g. by MPI): the job then runs without it."""
    try:
        # its keys under this attempt's prefix: torchrun's agent store outlives an attempt, and a verdict or the beats
        # of the attempt before (a hung rank named) must not end or confuse a restarted one
        store, prefix = connect(address, port, timeout_s), _placement.attempt_prefix()
        store = dist.PrefixStore(prefix, store) if prefix else store
        beat = Heartbeat(store, rank, placement, timeout_s)
        beat.start()
    except (RuntimeError, OSError) as error:  # torch's DistStoreError is a RuntimeError
        log.warning(f"HorizonStrategy heartbeat, rank {rank}: off, no rendezvous store answers at {address}:{port}"
                    f" ({error}); a hung peer is noticed at the collective timeout only")
        return None
    return beat


def beats(before: Optional[str] = None,
          after: Optional[str] = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A strategy hook that passes points of the program: the strategy's heartbeat (its ``heartbeat`` attribute,
    ``None``: none) beats ``before`` as the hook begins and ``after`` once it returned, each where given."""

    def wrap(hook: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(hook)
        def beating(strategy: Any, *args: Any, **kwargs: Any) -> Any:
            if before is not None and strategy.heartbeat is not None:
                strategy.heartbeat.beat(before)
            out = hook(strategy, *args, **kwargs)
            if after is not None and strategy.heartbeat is not None:
                strategy.heartbeat.beat(after)
            return out
        return beating
    return wrap


class Heartbeat:
    """This rank's beat and its watch over the others' (module docstring). ``placement``: every rank's row (rank,
    node, host, pid); ``store``: the side channel (:func:`connect`); ``end``: what ends this process (tests replace
    it)."""

    def __init__(self, store: Any, rank: int, placement: list[dict[str, Any]], timeout_s: float,
                 interval_s: Optional[float] = None, end: Callable[[int], None] = os._exit) -> None:
        self.store, self.rank, self.placement, self.timeout_s = store, rank, placement, timeout_s
        self._rows = {row["rank"]: row for row in placement}
        self.interval_s = interval_s if interval_s is not None else min(2.0, max(0.1, timeout_s / 6))
        self._end = end
        self._progress, self._where = 0, "setup"  # written by the training thread, read by the watcher
        self._seq = 0  # this rank's beats written
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._seen: dict[int, dict[str, Any]] = {}  # peer -> its last beat and when (monotonic) each part moved
        self._mine = (0, time.monotonic())  # this rank's progress and when it last moved
        self._store_ok = time.monotonic()
        self._pending: Optional[threading.Event] = None  # a store exchange that has not returned yet

    # ------------------------------------------------------------------ the training thread

    def beat(self, where: str) -> None:
        """The training thread passed a point of the program (no I/O here: the watcher writes)."""
        self._progress += 1
        self._where = where

    def start(self) -> None:
        self._write("alive")
        self._thread = threading.Thread(target=self._run, name="horizon-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the watch and tell the peers this rank is done (they stop watching it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + self.timeout_s)
        try:
            self._write("done")
        except Exception:  # the store is gone with rank 0's process: nobody is watching any more
            pass

    # ------------------------------------------------------------------ the watcher thread

    def _write(self, state: str) -> None:
        self._seq += 1
        beat = {"seq": self._seq, "progress": self._progress, "where": self._where, "state": state}
        self.store.set(f"{PREFIX}{self.rank}", json.dumps(beat))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            verdict = self.check()
            if verdict is not None:
                self._finish(*verdict)
                return

    def check(self, now: Optional[float] = None) -> Optional[tuple[str, list[int]]]:
        """One round: write this rank's beat, read the others'; ``(message, ranks to kill)`` when the job must end."""
        now = time.monotonic() if now is None else now
        try:
            verdict, beats = self._exchange()
        except Exception as error:  # unreachable: give it the timeout, then end
            if now - self._store_ok > self.timeout_s:
                return self._unreachable(now - self._store_ok, error)
            return None
        self._store_ok = now
        if verdict is not None:
            return f"{self._says()} rank {verdict['by']} named {verdict['named']}. {self._ending()}", []
        if self._progress != self._mine[0]:
            self._mine = (self._progress, now)
        hung = []
        for peer, beat in beats.items():
            if beat is None or beat["state"] != "alive":
                self._seen.pop(peer, None)  # not started yet, or done with this fit: not watched
                continue
            seen = self._seen.get(peer)
            if seen is None or beat["seq"] < seen["seq"]:  # first sight, or a new fit's beat
                self._seen[peer] = {**beat, "seq_at": now, "progress_at": now}
                continue
            if beat["seq"] != seen["seq"]:
                seen.update(seq=beat["seq"], seq_at=now, where=beat["where"])
            if beat["progress"] != seen["progress"]:
                seen.update(progress=beat["progress"], progress_at=now)
            silent = now - seen["seq_at"]
            stuck = min(now - seen["progress_at"], now - self._mine[1])
            if silent > self.timeout_s:
                hung.append((peer, f"sent no heartbeat for {silent:.0f} s (stopped, swapped out, or its host is"
                                   f" gone; last in {seen['where']})"))
            elif seen["progress"] < self._progress and stuck > self.timeout_s:
                hung.append((peer, f"has made no progress for {stuck:.0f} s, in {seen['where']}, while rank"
                                   f" {self.rank} waits for it in {self._where}"))
        if not hung:
            return None
        rows = self._rows
        named = "; ".join(f"rank {peer} (node {rows[peer]['node']}, host {rows[peer]['host']}, pid"
                          f" {rows[peer]['pid']}) {why}" for peer, why in hung)
        try:
            self.store.set(VERDICT, json.dumps({"by": self.rank, "named": named}))
        except Exception:
            pass
        here = liveness.host()
        return f"{self._says()} {named}. {self._ending()}", [peer for peer, _ in hung if rows[peer]["host"] == here]

    def _says(self) -> str:
        return f"HorizonStrategy heartbeat, rank {self.rank}:"

    def _ending(self) -> str:
        return (f"heartbeat_timeout={self.timeout_s:g} s; ending the job (exit {EXIT_CODE}); resume with"
                " ckpt_path='last'")

    def _exchange(self) -> tuple[Optional[dict[str, Any]], dict[int, Optional[dict[str, Any]]]]:
        """Write this rank's beat; read the verdict and every peer's beat. A store whose server does not answer (its
        process stopped) blocks a read for good, whatever the client's timeout: the calls run on a thread of their
        own, given one round; one that has not returned by then fails this round and every round after it until it
        does."""
        if self._pending is not None and not self._pending.is_set():
            raise TimeoutError("the store has not answered a read for a round or more")
        done, result = threading.Event(), {}

        def work() -> None:
            try:
                self._write("alive")
                result["verdict"] = self._read(VERDICT)
                result["beats"] = {row["rank"]: self._read(f"{PREFIX}{row['rank']}") for row in self.placement
                                   if row["rank"] != self.rank}
            except Exception as error:
                result["error"] = error
            finally:
                done.set()

        threading.Thread(target=work, name="horizon-heartbeat-io", daemon=True).start()
        if not done.wait(max(self.interval_s, 1.0)):
            self._pending = done
            raise TimeoutError("the store did not answer within a round")
        if "error" in result:
            raise result["error"]
        return result["verdict"], result["beats"]

    def _read(self, key: str) -> Optional[dict[str, Any]]:
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _unreachable(self, seconds: float, error: BaseException) -> tuple[str, list[int]]:
        """The store (served by rank 0's process) has not answered for ``seconds``: ranks on this host whose process
        is stopped are named and killed; else rank 0's process or host is gone."""
        here = liveness.host()
        stopped = [row for row in self.placement if row["rank"] != self.rank and row["host"] == here
                   and liveness.process_state(row["pid"]) in ("T", "t")]
        cause = "rank 0's process or host is gone, or stopped on another host"
        if stopped:
            cause = "; ".join(f"rank {row['rank']} (node {row['node']}, host {here}, pid {row['pid']}) is stopped"
                              for row in stopped)
        return (f"{self._says()} cannot reach the rendezvous store for {seconds:.0f} s ({error}): {cause}."
                f" {self._ending()}", [row["rank"] for row in stopped])

    def _finish(self, message: str, kill: list[int]) -> None:
        log.error(message)
        # Every rank reads the verdict within a round: until then nobody ends and nobody is killed, so that no rank
        # meets a closed connection in a collective first (and names the wrong peer, with another status).
        time.sleep(1.5 * self.interval_s)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        for peer in kill:
            try:
                os.kill(self._rows[peer]["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._end(EXIT_CODE)
