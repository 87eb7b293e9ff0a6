"""A rank that dies mid-step ends the whole job fast, with the lost rank named and no process left behind.

Two worlds run in one launch, their ranks forked after its imports (tests/launch.py's ``run_worlds``): the launch
reaps every rank of a world before it starts the next, so a rank left behind holds the launch until its hard
timeout, which fails the tests. Rank 0's death runs under Lightning's own launcher, whose main process is rank 0:
its child rank must notice and end too (run_script returns only when every process holding the output pipe has
exited).
"""

import time
from pathlib import Path

import pytest

from tests.launch import run_script, run_worlds

DIE = Path(__file__).parent / "scripts" / "die.py"
TIMEOUT_S = 60  # the collective (and rendezvous) timeout given to the strategy
MARGIN_S = 40  # process start and `import lightning` on a loaded 2-core machine
FORKED = [(2, 1, "exit"), (4, 2, "kill")]  # (devices, victim, how)
LAUNCHED = (2, 0, "kill")  # under Lightning's launcher


@pytest.fixture(scope="module")
def deaths(tmp_path_factory) -> dict[tuple, dict]:
    """``{(devices, victim, how): {"exit": [status per process] (forked worlds only), "returncode": the launch's
    (Lightning's only), "seconds": s, "log": text}}``."""
    tags = {case: "-".join(map(str, case)) for case in FORKED}
    jobs = [{"tag": tag, "call": "tests.scripts.die:fit", "args": [*case, TIMEOUT_S], "devices": case[0]}
            for case, tag in tags.items()]
    ended, output = run_worlds(jobs, tmp_path_factory.mktemp("faults"), timeout=len(jobs) * (TIMEOUT_S + MARGIN_S),
                               check=False)
    assert set(tags.values()) <= ended.keys(), f"jobs that ended: {sorted(ended)}\n{output[-6000:]}"
    found = {case: ended[tag] for case, tag in tags.items()}
    start = time.monotonic()
    result = run_script(DIE, [*LAUNCHED, TIMEOUT_S], timeout=TIMEOUT_S + MARGIN_S, check=False)
    found[LAUNCHED] = {"returncode": result.returncode, "seconds": time.monotonic() - start, "log": result.stdout}
    return found


@pytest.mark.parametrize(("devices", "victim", "how"), [*FORKED, LAUNCHED])
def test_dead_rank_ends_every_rank(deaths, devices, victim, how):
    death = deaths[(devices, victim, how)]
    out = death["log"]
    assert f"rank {victim} dies now" in out
    assert "FINISHED" not in out
    if "exit" in death:  # every rank ended, the victim as it died and every other with an error
        assert len(death["exit"]) == devices and death["exit"][victim] == (3 if how == "exit" else -9), death["exit"]
        assert all(code != 0 for code in death["exit"]), death["exit"]
    else:
        assert death["returncode"] != 0
    assert f"lost: rank {victim} (node 0)" in out, out[-3000:]
    assert death["seconds"] < TIMEOUT_S + MARGIN_S
