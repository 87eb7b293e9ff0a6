"""Which rank was lost, when a collective fails because a peer is gone.

Gloo reports a dead peer as a socket error naming an address ("Connection closed by peer [10.0.0.2]:41235"),
and a peer that hangs as a timeout: neither names the rank. Every rank records its host and pid at setup (the
strategy's placement table); when a collective fails, the surviving rank checks the pids of the ranks on its own
host and names those that are no longer running. Ranks on other hosts cannot be checked from here and are
listed as such, with the node they were on.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from typing import Any, Optional

log = logging.getLogger("lightning_horizon.strategy")  # the strategy's log: where its user looks

_LOST_PEER = re.compile(
    r"connection (closed|reset)|broken pipe|read error|timed? ?out|timeout|socket|peer|gloo|closed by",
    re.IGNORECASE,
)


def host() -> str:
    return socket.gethostname()


def looks_like_lost_peer(exception: BaseException) -> bool:
    """A collective's error that a dead or hung peer produces (socket errors, timeouts)."""
    return isinstance(exception, (RuntimeError, ConnectionError, TimeoutError)) and bool(
        _LOST_PEER.search(str(exception))
    )


def process_state(pid: int) -> Optional[str]:
    """The state letter of a process on this host (``/proc/<pid>/stat``: "R", "S", "D", "T" stopped, "Z" zombie,
    ...), or ``None`` when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return process_state(pid) != "Z"  # an exited child its launcher has not reaped yet: gone for our purpose


def lost_ranks(placement: list[dict[str, Any]], me: int) -> tuple[list[int], list[int]]:
    """``(dead, unchecked)``: ranks on this host whose process is gone, and ranks on other hosts."""
    here = host()
    dead, unchecked = [], []
    for row in placement:
        if row["rank"] == me:
            continue
        if row.get("host") != here:
            unchecked.append(row["rank"])
        elif not _running(row["pid"]):
            dead.append(row["rank"])
    return dead, unchecked


#: how long a peer whose sockets closed may take to be gone: a killed process closes its sockets while it exits,
#: before it is a zombie, so the first look can still see it running (seen on a loaded 2-core machine)
EXIT_GRACE_S = 3.0


def name_lost_peer(exception: BaseException, placement: list[dict[str, Any]], me: int, timeout_s: float) -> None:
    """Log which peer was lost when ``exception`` looks like a dead or hung one (a socket error or a timeout that
    names no rank); nothing with one rank, or before setup recorded the placement."""
    if len(placement) > 1 and looks_like_lost_peer(exception):
        log.error(describe(placement, me, timeout_s))


def describe(placement: list[dict[str, Any]], me: int, timeout_s: float) -> str:
    deadline = time.monotonic() + EXIT_GRACE_S
    dead, unchecked = lost_ranks(placement, me)
    while not dead and time.monotonic() < deadline:
        time.sleep(0.05)
        dead, unchecked = lost_ranks(placement, me)
    node_of = {row["rank"]: row["node"] for row in placement}
    parts = [f"HorizonStrategy: rank {me} (node {node_of.get(me)}) lost a peer in a collective"]
    if dead:
        parts.append("lost: " + ", ".join(f"rank {r} (node {node_of[r]})" for r in dead))
    if unchecked:
        nodes = sorted({node_of[r] for r in unchecked})
        parts.append(f"on other hosts, not checked from here: ranks {unchecked} (nodes {nodes})")
    if not dead and not unchecked:
        parts.append(f"every rank on this host is still running: a peer is hung (timeout {timeout_s:g} s)")
    return "; ".join(parts) + ". Ending this rank; resume with ckpt_path='last'."
