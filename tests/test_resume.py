"""Exact mid-epoch resume under HorizonStrategy, also into another world size (lightning_horizon/data_position.py).

One launch (tests/launch.py's ``run_worlds``: the imports paid once, every world's ranks forked from it, one hard
timeout, every process reaped) runs four worlds in turn:

1. 2 ranks as 2 emulated nodes x 1: for each loader kind an uninterrupted run, a run interrupted mid-epoch (every
   rank stops in the same step, after that step's checkpoint was written) and its resume; and the reference of the
   resumes into other world sizes (float64, ``precision="64-true"``), interrupted mid-epoch too.
2. 4 ranks as 2 nodes x 2: that reference interrupted at 4 ranks, and the 2-rank interruption resumed at 4 ranks
   (half the per-rank batch: the same global batch).
3. 2 ranks: the 4-rank interruption resumed at 2.
4. 1 rank: the 2-rank (2-node) interruption resumed at 1 (twice the per-rank batch), and resumed with another
   global batch (a warning names both).

Every dataset returns its sample's index; every rank records the indices of every step.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.launch import REPO, assert_exited, run_worlds

SCRIPT = REPO / "tests" / "scripts" / "resume_fit.py"
TORCHDATA = importlib.util.find_spec("torchdata") is not None

SAMPLES, BATCH, STEPS, STOP = 48, 4, 20, 9  # 2 ranks x 4: 6 steps an epoch; stopped in epoch 1, after its 3rd batch
#: loader kind -> run options; each gets an uninterrupted run, a stopped one and its resume, at 2 ranks
KINDS = {
    "plain": {"dropout": 0.2},                                   # shuffle=True: Lightning's DistributedSampler
    "sequential": {"shuffle": False},                            # shuffle=False: Lightning's sampler shuffles anyway
    "workers": {"workers": 2, "dropout": 0.2},                   # DataLoader workers prefetch ahead of the loop
    "dict": {"loader": "dict"},                                  # CombinedLoader of two; the shorter one cycles
    # use_distributed_sampler=False: each rank walks the whole dataset with its own RandomSampler / SequentialSampler
    "own_random": {"use_distributed_sampler": False, "workers": 2, "dropout": 0.2},
    "own_sequential": {"use_distributed_sampler": False, "shuffle": False},
    "onecycle": {"onecycle": True, "max_steps": -1, "max_epochs": 3, "dropout": 0.2},  # loader made in setup
    # torchdata's StatefulDataLoader keeps its own state through the same protocol. shuffle=False: Lightning's
    # DistributedSampler shuffles the training data anyway (shuffle=True would give its DistributedSamplerWrapper
    # around torchdata's own RandomSampler, whose generator the wrapper hides from torchdata's state)
    "torchdata": {"loader": "torchdata", "workers": 2, "shuffle": False},
    "torchdata_iterable": {"loader": "torchdata_iterable"},  # Lightning's fetcher takes a batch ahead of it
    # Lightning restores no loader made in configure_optimizers; the strategy does
    "torchdata_onecycle": {"loader": "torchdata", "shuffle": False, "onecycle": True, "max_steps": -1,
                           "max_epochs": 3},
}
RUN = [kind for kind in KINDS if TORCHDATA or not kind.startswith("torchdata")]
F64 = {"precision": "64-true"}
#: resumes into other world sizes: name -> (devices, ranks per node, per-rank batch, resumed from)
CROSS = {"w2_to_w4": (4, 2, 2, "ref2_stop"), "w4_to_w2": (2, 1, 4, "ref4_stop"), "w2_to_w1": (1, 1, 8, "ref2_stop"),
         "w2_to_w1_batch4": (1, 1, 4, "ref2_stop")}


def _run(work: Path, name: str, devices: int, per_node: int, batch: int, **options) -> dict:
    run = {"name": name, "devices": devices, "ranks_per_node": per_node, "batch": batch, "samples": SAMPLES,
           "max_steps": STEPS, "ckpt_dir": str(work / name), **options}
    if run.get("resume_from"):
        run["resume_from"] = str(work / run["resume_from"])
    return run


def _job(work: Path, tag: str, devices: int, runs: list[dict]) -> dict:
    (work / f"{tag}.json").write_text(json.dumps(runs))
    return {"tag": tag, "devices": devices, "call": f"{SCRIPT}:fit_all", "args": [str(work / f"{tag}.json"),
            str(work)], "env": {"OMP_NUM_THREADS": "1"}}


@pytest.fixture(scope="module")
def resumes(tmp_path_factory):
    work = tmp_path_factory.mktemp("resumes")
    two = []
    for kind in RUN:
        options = KINDS[kind]
        two += [_run(work, f"{kind}_whole", 2, 1, BATCH, **options),
                _run(work, f"{kind}_stop", 2, 1, BATCH, stop_at=STOP, **options),
                _run(work, f"{kind}_resumed", 2, 1, BATCH, resume_from=f"{kind}_stop", **options)]
    two += [_run(work, "ref2_whole", 2, 1, BATCH, **F64), _run(work, "ref2_stop", 2, 1, BATCH, stop_at=STOP, **F64)]
    cross = {name: _run(work, name, devices, per_node, batch, resume_from=source, **F64)
             for name, (devices, per_node, batch, source) in CROSS.items()}
    jobs = [_job(work, "two", 2, two),
            _job(work, "four", 4, [_run(work, "ref4_stop", 4, 2, BATCH // 2, stop_at=STOP, **F64),
                                   cross["w2_to_w4"]]),
            _job(work, "two_again", 2, [cross["w4_to_w2"]]),
            # plain Lightning ("ddp") resumes a mid-epoch checkpoint of HorizonStrategy's (its loader restarts the epoch)
            _job(work, "lightning", 2, [_run(work, "ddp_resumed", 2, 1, BATCH, resume_from="plain_stop",
                                             lightning_ddp=True, **KINDS["plain"])]),
            _job(work, "one", 1, [cross["w2_to_w1"], cross["w2_to_w1_batch4"]])]
    ended, output = run_worlds(jobs, work, timeout=400)
    for job in jobs:
        assert_exited(ended, job["tag"], [0] * job["devices"])

    def result(name: str, rank: int, weights: bool = True):
        info = json.loads((work / f"{name}.rank{rank}.json").read_text())
        return info, torch.load(work / f"{name}.rank{rank}.pt", weights_only=True) if weights else None

    yield result, ended
    shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=pytest.mark.skipif(
    kind not in RUN, reason="torchdata is not installed")) for kind in KINDS])
def test_mid_epoch_resume_is_bit_identical(resumes, kind):
    result, _ = resumes
    for rank in range(2):
        (whole, w), (resumed, r) = result(f"{kind}_whole", rank), result(f"{kind}_resumed", rank)
        stopped, _ = result(f"{kind}_stop", rank, weights=False)
        assert stopped["stopped"] and stopped["rows"][-1]["step"] == STOP - 1
        first = resumed["rows"][0]
        # the resume trains on the next batch of the same epoch, the one the uninterrupted run trained on
        per_epoch = SAMPLES // BATCH // (1 if KINDS[kind].get("use_distributed_sampler", True) is False else 2)
        assert first["step"] == STOP and (first["epoch"], first["batch_idx"]) == divmod(STOP, per_epoch), first
        assert first["batch_idx"] > 0  # mid-epoch
        assert whole["global_step"] == resumed["global_step"]
        later = [row for row in whole["rows"] if row["step"] >= STOP]
        assert [row["indices"] for row in resumed["rows"]] == [row["indices"] for row in later]
        assert [row["weights"] for row in resumed["rows"]] == [row["weights"] for row in later]  # every step
        assert w.keys() == r.keys() and all(torch.equal(w[k], r[k]) for k in w), f"rank {rank} differs"


def _global_batches(result, name: str, devices: int) -> dict[int, list[int]]:
    """step -> the sorted indices every rank trained on in that step (the global batch)."""
    steps: dict[int, list[int]] = {}
    for rank in range(devices):
        for row in result(name, rank, weights=False)[0]["rows"]:
            steps.setdefault(row["step"], []).extend(row["indices"][0])
    return {s: sorted(i) for s, i in steps.items()}


@pytest.mark.parametrize("name", ["w2_to_w4", "w4_to_w2", "w2_to_w1"])
def test_resume_into_another_world_size_keeps_the_sample_order(resumes, name):
    result, _ = resumes
    devices, _, _, source = CROSS[name]
    reference = _global_batches(result, "ref2_whole", 2)
    stopped = _global_batches(result, source, 4 if source == "ref4_stop" else 2)
    resumed = _global_batches(result, name, devices)
    assert sorted(resumed) == list(range(STOP, STEPS)) and sorted(stopped) == list(range(STOP))
    # the same global batches, step by step: before the interruption (at its world size) and after it (at this one)
    assert {**stopped, **resumed} == reference
    for epoch in range(STEPS * 2 * BATCH // SAMPLES):  # every whole epoch: each sample once, none skipped
        trained = [i for s in range(epoch * 6, epoch * 6 + 6) for i in reference[s]]
        assert sorted(trained) == list(range(SAMPLES))
    (_, ref) = result("ref2_whole", 0)
    for rank in range(devices):
        (_, got) = result(name, rank)
        assert max(float((ref[k] - got[k]).abs().max()) for k in ref) <= 1e-10, rank


def test_no_loader_restarts_its_epoch(resumes):
    _, ended = resumes
    for tag, job in ended.items():  # neither Lightning's warning nor ours: every loader resumed where it stood
        if tag == "lightning":
            continue
        assert "dataloader is not resumable" not in job["log"] and "holds no position" not in job["log"], tag


def test_plain_lightning_resumes_a_checkpoint_of_ours(resumes):
    """A mid-epoch checkpoint written under HorizonStrategy, resumed under Lightning's own "ddp": it loads (Lightning
    refuses loader states its loaders cannot take) and goes on from the saved step, its loader restarting the epoch
    as Lightning's does, with Lightning's warning."""
    result, ended = resumes
    assert "dataloader is not resumable" in ended["lightning"]["log"].replace("\n", " ")
    for rank in range(2):
        resumed, weights = result("ddp_resumed", rank)
        assert resumed["rows"][0]["step"] == STOP and resumed["global_step"] == STEPS
        assert all(torch.isfinite(w).all() for w in weights.values())


def test_another_global_batch_is_named(resumes):
    result, ended = resumes
    log = ended["one"]["log"]
    assert ("the checkpoint's global batch was 8 samples (2 ranks), this run's is 4 (1 ranks x 4): epoch 1"
            " continues at sample 12 of its order instead of 24") in log.replace("\n", " "), log[-3000:]
    # without the warning for the resume that keeps the global batch
    assert log.count("global batch was") == 1
    assert ("checkpoint saved with world size 2, resuming with 1: per-rank state (RNG, collectives, sharding)"
            " starts fresh; the training data resumes at its global position") in log.replace("\n", " ")


def test_position_samplers_keep_the_order_they_stand_for():
    """In process: the samplers HorizonStrategy puts in the training loader walk their originals' order and draw
    from torch's generator as they do (an uninterrupted run is the run without them, batch for batch)."""
    from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

    from lightning_horizon.data_position import PositionSampler, ReplaySampler

    data = list(range(37))
    for rank in range(3):
        original = DistributedSampler(data, num_replicas=3, rank=rank, shuffle=True, seed=5)
        original.set_epoch(4)
        assert list(PositionSampler(original)) == list(original)
    for make in (lambda: RandomSampler(data), lambda: RandomSampler(data, num_samples=50, replacement=True),
                 lambda: RandomSampler(data, generator=torch.Generator().manual_seed(3)),
                 lambda: SequentialSampler(data)):
        torch.manual_seed(9)
        original = make()
        expected, after = [list(original) for _ in range(2)], torch.get_rng_state()
        torch.manual_seed(9)
        replay = ReplaySampler(make())
        assert [list(replay) for _ in range(2)] == expected and torch.equal(torch.get_rng_state(), after)
