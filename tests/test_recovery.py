"""A job recovers by itself: under ``torchrun --max-restarts 1`` a rank SIGKILLed or SIGSTOPped in the middle of an
epoch restarts and resumes from the last complete checkpoint; a SIGTERM (a preemption) writes a checkpoint at the
step boundary every rank agreed on, and the next launch repeats no step. Each run's final weights are torch.equal to
the uninterrupted run's.

Real torchrun launches (``python -m torch.distributed.run``) of tests/scripts/recover_fit.py (2 ranks, a tiny MLP,
30 steps, 8 steps an epoch, a checkpoint every 5 steps; the fault at step 13: mid-epoch, 3 steps after the last
checkpoint), all started at once, each in its own process group under one hard timeout (tests/launch.py kills every
group). The stopped rank is noticed by the heartbeat (4 s), which ends the job with exit 75; torchrun restarts it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch

from tests.launch import run_scripts

SCRIPT = Path(__file__).parent / "scripts" / "recover_fit.py"
STEPS, SAMPLES, EVERY, AT = 30, 64, 5, 13  # 64 samples / (2 ranks x 4) = 8 steps an epoch: step 13 is mid-epoch
TIMEOUT_S = 240
RUNS = {
    "reference": {},
    "kill": {"fault": "kill", "victim": 1, "at": AT},
    "stop": {"fault": "stop", "victim": 1, "at": AT, "heartbeat": 4, "background": True},
    "term": {"fault": "term", "victim": 1, "at": AT, "background": True},
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(cfg: dict, restarts: int) -> tuple:
    """One launch of the script under torchrun (as tests.launch.run_scripts takes it: ``-m`` then the module)."""
    args = ["torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", str(restarts),
            "--master-port", str(_port()), SCRIPT, json.dumps(cfg)]
    return "-m", args, {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("recovery")
    cfgs = {name: {"out": str(work / name), "steps": STEPS, "samples": SAMPLES, "every": EVERY, **extra}
            for name, extra in RUNS.items()}
    names = list(cfgs)
    try:
        first = run_scripts([torchrun(cfgs[n], 0 if n in ("reference", "term") else 1) for n in names],
                            timeout=TIMEOUT_S, check=False)
        found = {n: {"first": r, "out": Path(cfgs[n]["out"])} for n, r in zip(names, first)}
        term_ckpt = Path(cfgs["term"]["out"]) / "ckpt" / "last.ckpt"
        found["term"]["preempted_step"] = (torch.load(term_ckpt, weights_only=False)["global_step"]
                                           if term_ckpt.exists() else None)
        found["term"]["again"] = run_scripts([torchrun(cfgs["term"], 0)], timeout=TIMEOUT_S, check=False)[0]
    finally:
        _kill_leftovers(str(work))
    return found


def _kill_leftovers(marker: str) -> None:
    """torchrun starts every rank in a session of its own: a launch killed at its timeout leaves its ranks, found by
    this test's own folder on their command line."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def _final_equal(runs: dict, name: str) -> None:
    ref = torch.load(runs["reference"]["out"] / "final.pt")
    assert (runs[name]["out"] / "final.pt").exists(), runs[name]["first"].stdout[-6000:]
    got = torch.load(runs[name]["out"] / "final.pt")
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), f"{name}: {key} differs from the uninterrupted run"


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_lost_rank_restarts_and_ends_equal_to_the_uninterrupted_run(runs, fault):
    run = runs[fault]
    log = run["first"].stdout
    assert runs["reference"]["first"].returncode == 0, runs["reference"]["first"].stdout[-6000:]
    assert run["first"].returncode == 0, log[-6000:]
    assert f"rank 1: fault {fault} at step {AT}" in log
    assert "connectFullMesh" not in log
    if fault == "stop":
        assert "rank 1 (node 0" in log and "(exit 75)" in log, log[-6000:]
    steps = _steps(run["out"])
    restarted = sorted({s["step"] for s in steps if s["attempt"] == 1 and s["rank"] == 0})
    last_ckpt = AT // EVERY * EVERY  # the checkpoint before the fault: step 10
    assert restarted == list(range(last_ckpt, STEPS)), restarted  # resumed where the last checkpoint left it
    _final_equal(runs, fault)


def test_sigterm_checkpoints_at_an_agreed_step_and_the_next_launch_repeats_none(runs):
    run = runs["term"]
    log = run["first"].stdout
    assert run["first"].returncode != 0  # torchrun's agent ends on SIGTERM: the scheduler starts the job again
    stopped = run["preempted_step"]
    assert stopped is not None, log[-6000:]
    # both ranks stopped after the same step, the one the checkpoint holds (the first step end after the signal
    # reached a rank: how many steps that is depends on how fast the agent forwards it)
    for rank in (0, 1):
        assert f"HorizonStrategy, rank {rank}: stopped for SIGTERM after step {stopped};" in log, log[-6000:]
    assert AT < stopped < STEPS
    assert run["again"].returncode == 0, run["again"].stdout[-6000:]
    rank0 = [s["step"] for s in _steps(run["out"]) if s["rank"] == 0]
    assert rank0 == list(range(STEPS)), rank0  # every step once: none lost, none repeated
    _final_equal(runs, "term")


def test_bench_faults_smoke(tmp_path):
    """recipes/bench_faults.py for seconds: the tiny GPT on 2 emulated nodes (network namespaces as root, else
    loopback), a rank SIGKILLed every 8 s under torchrun restarts; the figures come back and a fault recovered."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
    import bench_faults

    result = bench_faults.main(["--smoke", "--json", str(tmp_path / "r.json"), "--timeout", "60"])
    assert result["baseline"]["steps"] > 0 and result["baseline"]["goodput"] > 0
    faults = result["faulted"]["faults"]
    assert faults and faults[0]["recovered"], result["faulted"]
    assert faults[0]["steps_lost"] >= 0 and faults[0]["to_first_step_s"] > 0
    assert result["faulted"]["steps"] > 0
