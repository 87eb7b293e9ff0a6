"""The heartbeat: a peer that hangs is named on the other ranks and the job ends, with the last checkpoint intact.

The watch's rules run against a real rendezvous store (a TCPStore served in this process) with the clock given:
a silent peer, a peer stuck behind a rank that waits for it, a peer behind a rank that still moves (not named), a
peer done with its fit, the verdict reaching every rank, an unreachable store. Then two real 2-rank fits on gloo,
forked from one launch (tests/launch.py's ``run_worlds``), in which a rank hangs at step 3: rank 1 stopped by
SIGSTOP (4 ranks: every other rank names it), rank 1 asleep inside ``training_step`` (2 ranks), and rank 0, which
serves the store, stopped (2 ranks). The collective timeout there is an hour: only the heartbeat can end them.
"""

import json
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_horizon import heartbeat
from lightning_horizon.heartbeat import EXIT_CODE, Heartbeat
from tests.launch import run_worlds

TIMEOUT_S = 4.0  # heartbeat_timeout of the fits
MARGIN_S = 10.0  # what the job may take past it to end


def _ranks(store_port: int, n: int = 3, timeout_s: float = 10.0) -> list[Heartbeat]:
    placement = [{"rank": r, "node": 0, "host": "elsewhere", "pid": 0} for r in range(n)]  # nothing to kill here
    return [Heartbeat(heartbeat.connect("127.0.0.1", store_port, 5.0), r, placement, timeout_s, end=lambda code: None)
            for r in range(n)]


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    yield master


def test_a_silent_peer_is_named_after_the_timeout_and_not_before(store):
    a, b, c = _ranks(store.port)
    for t in (0.0, 1.0):
        for r in (a, b, c):
            assert r.check(now=t) is None
    assert a.check(now=9.0) is None and c.check(now=9.0) is None  # b has been silent 8 s: under the 10 s timeout
    a.check(now=11.5)
    message, kill = c.check(now=11.5)  # b silent 10.5 s: named by c (a, which also wrote, is alive)
    named = "rank 1 (node 0, host elsewhere, pid 0) sent no heartbeat for 10 s"
    assert message.startswith(f"HorizonStrategy heartbeat, rank 2: {named}") and "rank 0 " not in message
    assert "heartbeat_timeout=10 s; ending the job (exit 75)" in message and kill == []
    assert json.loads(store.get(heartbeat.VERDICT))["by"] == 2  # the verdict, for every rank
    verdict, _ = a.check(now=11.6)
    assert verdict.startswith(f"HorizonStrategy heartbeat, rank 0: rank 2 named {named}")


def test_a_peer_stuck_behind_a_waiting_rank_is_named_and_one_behind_a_moving_rank_is_not(store):
    a, b = _ranks(store.port, n=2)
    for r in (a, b):
        r.beat("training_step")
        r.check(now=0.0)
    for t in range(1, 31):  # b moves on at every round, a does not: a is slow, b does not wait for it
        b.beat("after training_step")
        assert a.check(now=float(t)) is None and b.check(now=float(t)) is None
    b.beat("backward (the gradient allreduce)")  # now b waits for a: both stand still from t = 31
    for t in (31.0, 41.0):
        assert a.check(now=t) is None and b.check(now=t) is None
    assert a.check(now=41.6) is None  # a is behind b: a never names b for it
    message, _ = b.check(now=41.6)  # a still for 41.6 s, b for 10.6 s
    assert "rank 0 (node 0, host elsewhere, pid 0) has made no progress for 11 s, in training_step, while rank 1" \
           " waits for it in backward (the gradient allreduce)" in message


def test_a_peer_done_with_its_fit_is_not_watched_and_a_new_fit_starts_afresh(store):
    a, b, _ = _ranks(store.port, n=3)
    a.check(now=0.0)
    b.check(now=0.0)
    b.stop()  # b's fit ended: its beat says so
    assert a.check(now=30.0) is None or "rank 1 " not in a.check(now=30.0)[0]
    b2 = _ranks(store.port, n=3)[1]  # b's next fit: its beats count from 1 again
    b2.check(now=31.0)
    assert "rank 1 " not in (a.check(now=32.0) or ("",))[0]


def test_an_unreachable_store_ends_the_rank_after_the_timeout():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    a = Heartbeat(heartbeat.connect("127.0.0.1", master.port, 1.0), 0,
                  [{"rank": 0, "node": 0, "host": "h", "pid": 0}, {"rank": 1, "node": 0, "host": "h", "pid": 0}],
                  10.0, end=lambda code: None)
    now = time.monotonic()
    assert a.check(now=now) is None
    del master  # rank 0's process is gone: nobody serves the store
    assert a.check(now=now + 5.0) is None
    message, kill = a.check(now=now + 10.5)
    assert "cannot reach the rendezvous store" in message and kill == []


# ------------------------------------------------------------------ real fits in which a rank hangs

#: tag: (how the victim hangs, the victim, devices). Rank 0 serves the rendezvous store: stopped, the others cannot
#: read any beat, and name it from its process state on their host.
CASES = {"stop": ("stop", 1, 4), "sleep": ("sleep", 1, 2), "stop-rank0": ("stop", 0, 2)}
WHY = {"stop": "sent no heartbeat", "sleep": "has made no progress", "stop-rank0": "is stopped"}


@pytest.fixture(scope="module")
def hangs(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("hangs")
    jobs = [{"tag": tag, "call": "tests.scripts.hang:fit", "devices": devices,
             "args": [devices, victim, how, TIMEOUT_S, str(work / f"ckpt-{tag}")]}
            for tag, (how, victim, devices) in CASES.items()]
    ended, output = run_worlds(jobs, work, timeout=len(jobs) * 90, check=False)
    assert set(CASES) <= ended.keys(), f"jobs that ended: {sorted(ended)}\n{output[-6000:]}"
    return {tag: {**ended[tag], "ckpt": work / f"ckpt-{tag}" / "last.ckpt"} for tag in CASES}


@pytest.mark.parametrize("tag", CASES)
def test_a_hung_rank_is_named_the_job_ends_and_the_last_checkpoint_stays(hangs, tag):
    job, (how, victim, devices) = hangs[tag], CASES[tag]
    out = job["log"]
    assert "FINISHED" not in out
    # the other ranks named the victim, killed it (same host) and ended with the heartbeat's status; nothing left
    # running (run_worlds waits for every rank of the job)
    assert job["exit"] == [-9 if r == victim else EXIT_CODE for r in range(devices)], f"{job['exit']}\n{out[-6000:]}"
    said = {}  # every other rank named it: as the one that did, or by its verdict
    for line in out.splitlines():
        if line.startswith("HorizonStrategy heartbeat, rank ") and f"rank {victim} (node 0, host " in line \
                and WHY[tag] in line:
            said[int(line.split()[3].rstrip(":"))] = line
    assert set(said) >= {r for r in range(devices) if r != victim}, out[-6000:]
    if how == "sleep":
        assert f"in training_step, while rank {1 - victim} waits for it in backward" in out, out[-6000:]
    hung_at = float(out.split(f"rank {victim} hangs now ({how}) at ")[1].split()[0])
    assert job["ended_at"] - hung_at < TIMEOUT_S + MARGIN_S, (job["ended_at"] - hung_at, out[-3000:])
    checkpoint = torch.load(job["ckpt"], weights_only=False)  # the last complete one: written after step 3
    assert checkpoint["global_step"] == 3


def test_no_store_at_the_address_leaves_the_heartbeat_off_with_a_warning(caplog):
    """A process group started without a TCPStore at MASTER_ADDR:MASTER_PORT (e.g. by MPI): the job runs on,
    without a heartbeat, and says so."""
    with caplog.at_level("WARNING", logger="lightning_horizon.strategy"):
        assert heartbeat.start("127.0.0.1", 1, 0, [{"rank": 0, "node": 0, "host": "h", "pid": 0}], 0.5) is None
    assert "heartbeat, rank 0: off, no rendezvous store answers at 127.0.0.1:1" in caplog.text
