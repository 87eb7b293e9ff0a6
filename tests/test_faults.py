"""A rank that dies mid-step ends the whole job fast, with the lost rank named and no process left behind."""

import time
from pathlib import Path

import pytest

from tests.launch import run_script

DIE = Path(__file__).parent / "scripts" / "die.py"
TIMEOUT_S = 60  # the collective (and rendezvous) timeout given to the strategy
MARGIN_S = 40  # process start and `import lightning` on a loaded 2-core machine


@pytest.mark.parametrize(("devices", "victim", "how"), [(2, 1, "exit"), (4, 2, "kill"), (2, 0, "kill")])
def test_dead_rank_ends_every_rank(devices, victim, how):
    start = time.monotonic()
    # run_script returns only when every process holding the output pipe (all ranks) has exited: a rank left
    # behind would hold it open until the hard timeout, which fails the test.
    result = run_script(DIE, [devices, victim, how, TIMEOUT_S], timeout=TIMEOUT_S + MARGIN_S, check=False)
    elapsed = time.monotonic() - start
    out = result.stdout
    assert f"rank {victim} dies now" in out
    assert "FINISHED" not in out
    assert result.returncode != 0
    assert f"lost: rank {victim} (node 0)" in out, out[-3000:]
    assert elapsed < TIMEOUT_S + MARGIN_S
