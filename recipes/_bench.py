"""What the bench_*.py scripts share: a worker's clean environment and a fresh memory cgroup per run.

A run measured in its own cgroup: the driver creates a child of its own memory cgroup (:func:`new_cgroup`, root
only; optionally with a memory limit), names it in the worker's environment (:data:`CGROUP_ENV`), and the worker
calls :func:`join_cgroup` first thing, before it imports torch, so that everything it (and any rank a launcher
starts from it) allocates is charged there. The driver reads the cgroup's figures (:func:`cgroup_stats`) once the
worker is gone and removes the folder (:func:`remove_cgroup`).

Emulated nodes (:class:`Namespaces`): as root, two network namespaces joined by a veth pair, optionally capped by
tc's tbf (:func:`default_burst`), which bench_collectives.py and bench_sync.py run their nodes in.

Nothing here imports torch or Lightning at module level: a worker imports this before it joins its cgroup.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

CGROUP_ENV = "HORIZON_BENCH_CGROUP"


def join_cgroup() -> None:
    """In a worker (or a rank its launcher started): join the run's cgroup named in :data:`CGROUP_ENV`, if any."""
    if os.environ.get(CGROUP_ENV):
        Path(os.environ[CGROUP_ENV], "cgroup.procs").write_text(str(os.getpid()))


@dataclass
class Cgroup:
    """A fresh memory cgroup: its folder, whether it is v1 or v2, and the memory limit set on it (None: none)."""

    path: Path
    v2: bool
    limit: Optional[int] = None

    @property
    def peak_file(self) -> str:
        return "memory.peak" if self.v2 else "memory.max_usage_in_bytes"

    @property
    def method(self) -> str:
        """How the peak is read, in words."""
        return "v2 memory.peak" if self.v2 else "v1 memory.max_usage_in_bytes"

    def peak(self) -> int:
        return int((self.path / self.peak_file).read_text())


def new_cgroup(prefix: str = "bench", limit: Optional[int] = None, swap: int = 0) -> Optional[Cgroup]:
    """A fresh child of this process's memory cgroup, or None (not root, no writable memory cgroup, or the limit
    cannot be set). ``limit``: bytes of memory for everything in it (v1: ``memory.limit_in_bytes`` and, where swap
    is accounted, ``memory.memsw.limit_in_bytes``; v2: ``memory.max`` and ``memory.swap.max``), ``swap`` bytes of
    swap beyond it (0: none)."""
    if os.geteuid() != 0:
        return None
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            base, is_v2 = Path("/sys/fs/cgroup/memory"), False
        elif controllers == "" and v2:
            base, is_v2 = Path("/sys/fs/cgroup"), True
        else:
            continue
        group = Cgroup(base / rel.strip().lstrip("/") / f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}", is_v2)
        try:
            group.path.mkdir()
        except OSError:
            continue
        if not (group.path / group.peak_file).exists():
            group.path.rmdir()
            continue
        if limit is not None:
            try:
                _set_limit(group, limit, swap)
            except OSError as e:
                print(f"warning: cannot set a memory limit on {group.path}: {e}", file=sys.stderr)
                group.path.rmdir()
                return None
        return group
    return None


def _set_limit(group: Cgroup, limit: int, swap: int = 0) -> None:
    if group.v2:
        (group.path / "memory.max").write_text(str(limit))
        if (group.path / "memory.swap.max").exists():
            (group.path / "memory.swap.max").write_text(str(swap))
    else:  # memory first: memsw may not go below it
        (group.path / "memory.limit_in_bytes").write_text(str(limit))
        if (group.path / "memory.memsw.limit_in_bytes").exists():
            (group.path / "memory.memsw.limit_in_bytes").write_text(str(limit + swap))
    group.limit = limit


def cgroup_stats(group: Cgroup) -> dict[str, int]:
    """The cgroup's peak, and how often it hit its limit: ``peak``, ``failcnt`` (v1: charges refused at the limit,
    the larger of ``memory.failcnt`` and ``memory.memsw.failcnt``, which counts them where memory+swap has the same
    limit; v2: ``memory.events`` ``max``; some kernels leave v1's at 0: 6.18 did here, through reclaim and an OOM
    kill), ``oom_kill`` (processes the OOM killer ended in it) where the kernel says."""
    out = {"peak": group.peak()}
    if group.v2:
        events = dict(line.split() for line in (group.path / "memory.events").read_text().splitlines())
        out.update({"failcnt": int(events.get("max", 0)), "oom_kill": int(events.get("oom_kill", 0))})
    else:
        out["failcnt"] = max(int((group.path / name).read_text()) for name in ("memory.failcnt",
                                                                              "memory.memsw.failcnt")
                             if (group.path / name).exists())
        oom = dict(line.split() for line in (group.path / "memory.oom_control").read_text().splitlines())
        if "oom_kill" in oom:
            out["oom_kill"] = int(oom["oom_kill"])
    return out


@contextmanager
def run_cgroup(env: dict[str, str], prefix: str, limit: Optional[int] = None,
               swap: int = 0) -> Iterator[Optional[Cgroup]]:
    """A fresh cgroup for one worker run (:func:`new_cgroup`), named in the worker's ``env``, removed afterwards;
    None where none can be made."""
    cg = new_cgroup(prefix, limit, swap)
    if cg:
        env[CGROUP_ENV] = str(cg.path)
    try:
        yield cg
    finally:
        if cg:
            remove_cgroup(cg.path)


def probe_cgroup(prefix: str, limit: Optional[int] = None) -> Optional[Cgroup]:
    """Whether the runs will get cgroups (one made and removed at once; its ``method`` and ``limit`` still say how)."""
    cg = new_cgroup(prefix, limit)
    if cg:
        remove_cgroup(cg.path)
    return cg


def remove_cgroup(group: Path) -> None:
    for _ in range(50):  # the killed ranks leave the cgroup as they are reaped
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    print(f"warning: could not remove {group}", file=sys.stderr)


def parse_size(text: str) -> int:
    """A size on the command line: ``1.5GiB``, ``800MiB``, ``2GB`` or plain bytes."""
    import argparse

    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1, "": 1}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    if t[len(num):] not in units:
        raise argparse.ArgumentTypeError(f"{text!r}: a size such as 1.5GiB, 800MiB or 1000000000")
    return int(float(num) * units[t[len(num):]])


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("?" where it says none)."""
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "?")


def cpu_line(*extra: str) -> str:
    """A benchmark's CPU line: the model, the machine, ``extra`` fields, the ISA and whether bf16 is native."""
    from lightning_horizon.cpu import isa
    from lightning_horizon.layout import Machine

    return " | ".join([f"CPU: {cpu_model()}", Machine.here().describe(), *extra,
                       f"ISA {isa().description}, native bf16: {'yes' if isa().native_bf16 else 'no'}"])


def parse_common(p: "argparse.ArgumentParser", argv: Optional[list[str]], smoke: dict,
                 worker: Callable[[dict, str], None], corpus: bool = True) -> "Optional[argparse.Namespace]":
    """Add the options every bench script has (the corpus and its cache where ``corpus``, timeout, JSON output,
    ``--smoke`` and the worker's own), then parse: with ``--smoke`` the ``smoke`` defaults apply (options given
    explicitly still win). SIGTERM becomes an exception, so that run_worker's cleanup kills a worker's process group
    (its own session). A worker process (``--worker SPEC``) runs ``worker(spec, out)`` here and gets None."""
    import argparse
    import json
    import signal

    if corpus:
        p.add_argument("--max-bytes", type=int, default=4 * 2**20, help="corpus bytes to tokenize (lm_data max_bytes)")
        p.add_argument("--cache-dir", default=None, help="token cache (default ~/.cache/lightning_horizon)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny defaults: " + ", ".join(f"{k}={v}" for k, v in
                                                                                   smoke.items()))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**smoke)  # explicit options still win
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.worker:
        worker(json.loads(a.worker), a.out)
        return None
    return a




# ---------------------------------------------------------------------- emulated nodes (root)


def run_launches(launches: list[tuple[list[str], dict[str, str]]], timeout: float) -> tuple[list[int], list[str]]:
    """Start every ``(command, environment)`` at once, each in its own session (one per emulated node: its
    launcher starts the node's other ranks), wait for all under one deadline, and kill every one of them, whatever
    happened. Returns their exit statuses and outputs."""
    import signal

    procs: list[subprocess.Popen] = []
    logs: list[str] = []
    try:
        for cmd, env in launches:
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        deadline = time.time() + timeout
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.time()))[0])
            except subprocess.TimeoutExpired:
                logs.append(f"timed out after {timeout:.0f} s")
    finally:
        for p in procs:  # every rank of every node, whatever happened
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [p.returncode for p in procs], logs


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Namespaces:
    """One network namespace per emulated node, deleted on exit. Two nodes are joined by a veth pair; more by a bridge
    in a namespace of its own (a switch), each node on its own veth port: ``shape`` caps both directions of every
    node's link, as a switch's ports would be."""

    def __init__(self, nodes: int = 2) -> None:
        if nodes < 2:
            raise ValueError(f"Namespaces(nodes={nodes}): allowed is an int >= 2")
        tag = f"{os.getpid() % 100000}"
        self.ns = [f"hzb{tag}n{i}" for i in range(nodes)]
        self.dev = [f"hzb{tag}v{i}" for i in range(nodes)]
        self.addr = [f"10.231.7.{i + 1}" for i in range(nodes)]
        self.switch = f"hzb{tag}sw" if nodes > 2 else None
        self.ports = [f"hzb{tag}p{i}" for i in range(nodes)] if self.switch else []
        self.namespaces = self.ns + ([self.switch] if self.switch else [])  # every one made, and deleted on exit

    def __enter__(self) -> "Namespaces":
        try:
            for ns in self.namespaces:
                _sh("ip", "netns", "add", ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
            if self.switch is None:
                _sh("ip", "link", "add", self.dev[0], "netns", self.ns[0], "type", "veth", "peer", "name",
                    self.dev[1], "netns", self.ns[1])
            else:
                _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
                _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
                for ns, dev, port in zip(self.ns, self.dev, self.ports):
                    _sh("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns",
                        self.switch)
                    _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                    _sh("ip", "-n", self.switch, "link", "set", port, "up")
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def shape(self, rate: str, burst: str) -> bool:
        """A tbf rate limit on both ends of every link; False when the kernel refuses it."""
        ends = list(zip(self.ns, self.dev)) + [(self.switch, port) for port in self.ports]
        for ns, dev in ends:
            r = _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", burst, "latency", "100ms", check=False)
            if r.returncode:
                print(f"tbf refused on {dev}: {r.stderr.strip()}")
                return False
        return True

    def __exit__(self, *exc) -> None:
        for ns in self.namespaces:
            _sh("ip", "netns", "del", ns, check=False)  # deleting a namespace deletes its ends of the veths

    def command(self, node: int) -> tuple[list[str], dict[str, str]]:
        """The command prefix and environment that run a process of emulated node ``node``."""
        env = {"GLOO_SOCKET_IFNAME": self.dev[node], "MASTER_ADDR": self.addr[0]}
        return ["ip", "netns", "exec", self.ns[node]], env


def default_burst(rate: str) -> str:
    """2 ms of ``rate`` (tc's units: "1gbit", "100mbit"), at least 64 KB, which tbf needs to hold the rate at a
    timer tick of a few ms: 250kb at 1 Gbit/s, 64kb at 100 Mbit/s."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    number, unit = re.fullmatch(r"([0-9.]+)([a-z]+)", rate.lower()).groups()
    return f"{max(64, round(float(number) * units[unit] / 8 * 2e-3 / 1000))}kb"


__all__ = ["CGROUP_ENV", "Cgroup", "Namespaces", "cgroup_stats", "cpu_line", "cpu_model", "default_burst",
           "join_cgroup", "new_cgroup", "parse_common", "parse_size", "probe_cgroup", "remove_cgroup", "run_cgroup",
           "run_launches"]
