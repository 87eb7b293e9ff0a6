"""The differential tester (tests/differential/): seeded examples of what a user writes and how it is trained,
each run with its references (the bit-for-bit twin without the capabilities documented as the same bits;
Lightning's "ddp" in float64) and compared on weights, optimizer state, checkpoints during and after fit, resumes,
evaluations and losses. A failing example is shrunk to the smallest configuration that still fails and printed with
a one-line reproduction. docs/composition.md ("The differential tester") has the space, the references and the
tolerances, the refusals and how to run many more examples:

    python -m tests.differential --examples 200 --world 1,2,4 --seed 1000

CI: fixed seeds at 1 and 2 ranks, the documented refusals, a planted defect (caught and shrunk), in one launch per
world size; ``-m slow``: hundreds more at 1, 2 and 4 ranks (2 emulated nodes x 2 or 1 x 4).
"""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import lightning.pytorch as L

from tests.differential.compare import signature
from tests.differential.plan import plan
from tests.differential.runner import Runner
from tests.differential.session import (Outcome, coverage, evaluate, format_coverage, minimize, report,
                                        run_session)
from tests.differential.shrink import shrink
from tests.differential.space import (REFUSED, constrain, draw, key, refusal, refused_examples, simplest,
                                      summary, twin_changes)

pytestmark = pytest.mark.timeout(1800)

CI_SEEDS = {1: range(10), 2: range(6)}
_W2 = {"world": 2, "rpn": 1, "bucket_mb": 0.0005, "steps": 4, "ckpt_during": True}  # 2 nodes x 1
_W4 = {"world": 4, "rpn": 2, "bucket_mb": 0.0005}  # 2 nodes x 2
#: one example per capability that needs 2 nodes (drawn at 4 ranks only in the slow runs), in the launches of 2 and
#: 4 ranks: every collectives algorithm, each codec, local SGD ending on an average and between two
FIXED = [
    {**simplest(2, seed=21), **_W2, "compression": "int8", "resume": {"from": "during", "layout": "same"},
     "save_after": True, "model": {**simplest()["model"], "tied": True}, "precision": "32-true", "sharding": "auto"},
    {**simplest(2, seed=22), **_W2, "sync_every": 3, "optimizer": {"name": "Adamax", "kwargs": {"lr": 2e-2}},
     "resume": {"from": "during", "layout": "same"}},
    # int8 under 64-true: the C kernel's buffers in fp32 whatever the default dtype (float64 here: it raised)
    {**simplest(2, seed=27), **_W2, "compression": "int8", "optimization": "manual"},
    # DiLoCo's outer step, overlapped: the checkpoint at step 2 holds the exchange of the sync at step 2; the blocks
    # compiled (under DDP: dynamo's DDPOptimizer splits their graphs at the buckets)
    {**simplest(2, seed=26), **_W2, "sync_every": 2, "outer": "nesterov", "overlap": True, "steps": 4,
     "model": {**simplest()["model"], "compile": True},
     "optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-2, "weight_decay": 0.1}},
     "resume": {"from": "during", "layout": "same"}},
    # the same example but for the collectives and the codec: one Lightning "ddp" fit is the reference of both
    {**simplest(4, seed=23), **_W4, "collectives": "torus2d", "torus_shape": [1, 4], "compression": "bf16"},
    {**simplest(4, seed=23), **_W4, "collectives": "hierarchical", "compression": "int8"},
    {**simplest(4, seed=23), **_W4, "collectives": "auto", "cost_model": "slow",
     "optimizer": {"name": "Adagrad", "kwargs": {"lr": 0.1, "initial_accumulator_value": 0.1, "lr_decay": 0.01}}},
    # node_sharded state in shard groups across nodes: both nodes of 1 rank hold one copy (eager Adagrad state, a
    # checkpoint after fit, a resume into replicated); 2 nodes x 2 hold one copy over 4 ranks, under a clip
    {**simplest(2, seed=24), **_W2, "state": "node_sharded", "shard_nodes": 2, "save_after": True,
     "optimizer": {"name": "Adagrad", "kwargs": {"lr": 0.1}}, "resume": {"from": "during", "layout": "replicated"}},
    {**simplest(4, seed=25), **_W4, "state": "node_sharded", "shard_nodes": 2, "model": {**simplest()["model"],
     "tied": True, "never": True}, "optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-2, "weight_decay": 0.1}},
     "clip": {"where": "trainer", "algorithm": "norm", "value": 0.05}},
    # a sharded embedding table (embedding.md) whose per-sample weights come from a parameter: span="auto" (moved at
    # its first lookup, by the "slow" links), a schedule whose initial_lr is its own, a clip by the global norm, a
    # resume on one rank; a copy per node (span="node"), its rows on disk, on 2 nodes x 2 with a codec on the rest,
    # recompute and GradNormBackoff
    {**simplest(2, seed=28), **_W2, "model": {**simplest()["model"], "bag": "auto", "groups": True,
                                              "bag_weights": True},
     "scheduler": {"name": "OneCycleLR", "interval": "step"}, "clip": {"where": "trainer", "algorithm": "norm",
                                                                        "value": 0.05},
     "resume": {"from": "during", "layout": "world1"}},
    {**simplest(4, seed=29), **_W4, "model": {**simplest()["model"], "bag": "node", "bag_weights": True,
                                              "bag_disk": True},
     "collectives": "hierarchical", "compression": "int8", "sharding": "forced", "backoff": {"max_norm": 0.05}},
]
#: library defects found by the tester and not fixed yet: the example's index in FIXED -> the defect (none now;
#: such an example must fail against "ddp" only, and passes the day it is fixed: then its entry goes)
KNOWN: dict[int, str] = {}
#: a planted defect: every reference's learning rate x (1 + 1e-6), on an example a few simplifications from simplest
PLANTED = {**simplest(1, seed=3), "optimizer": {"name": "Adam", "kwargs": {"lr": 1e-2}}, "accumulate": 2,
           "scheduler": {"name": "StepLR", "interval": "step"}, "model": {**simplest()["model"], "groups": True},
           "plant": True}
SHRINK = os.environ.get("DIFFERENTIAL_SHRINK", "1") != "0"


def ci_examples() -> list[dict]:
    return [draw(s, w) for w, seeds in CI_SEEDS.items() for s in seeds] + [constrain(ex) for ex in FIXED]


# ---------------------------------------------------------------------------------------------- no processes


def test_generator_is_deterministic_constrained_and_compared_with_a_reference():
    examples = [draw(s, w) for w in (1, 2, 4) for s in range(1000)]
    assert examples == [draw(s, w) for w in (1, 2, 4) for s in range(1000)]
    assert all(constrain(ex) == ex for ex in examples)  # constraints are a fixed point of every draw
    for ex in examples:
        p = plan(ex)
        if p.refused is None:
            assert p.refs, ex  # every example has a reference the docs make a promise about
            assert "ddp" in p.refs or twin_changes(ex)
        else:
            assert not p.refs and p.main["expect_error"]
    refused = {refusal(ex)[0] for ex in examples if refusal(ex)}
    assert refused == {r[0] for r in REFUSED}  # every refusal is drawn now and then


def test_ci_examples_draw_every_capability_and_lifecycle_step():
    c = coverage(ci_examples() + refused_examples())
    print("\n" + format_coverage(c))
    wanted = {
        "model": {"zoo", "transformer", "boring"},
        "state": {"replicated", "node_sharded (2 per node)", "node_sharded (1 per node, shard groups of 2 nodes)",
                  "node_sharded (2 per node, shard groups of 2 nodes)"},
        "store": {"auto", "after_backward"}, "sharding": {"auto", "forced"},
        "precision": {"64-true", "32-true", "bf16-mixed", "bf16-true+fp32", "bf16-true+kahan"},
        "optimization": {"automatic", "manual"}, "accumulate": {1, 2},
        "compression": {"None", "bf16", "int8"}, "sync_every": {1, 2, 3},
    }
    wanted["model flags"] = {"bag", "compile", "bag_weights", "bag_disk"}
    for dim, values in wanted.items():
        assert values <= {k for k, v in c[dim].items() if v}, (dim, c[dim])
    lifecycle = {k for k, v in c["lifecycle"].items() if v}
    assert {"checkpoint during fit", "checkpoint mid-epoch", "save after fit"} <= lifecycle
    assert any(k.startswith("resume from during") for k in lifecycle)
    assert "resume from during (regrid)" in lifecycle  # into another world size, the same global batch
    assert any(k.startswith("resume from after") for k in lifecycle)
    assert {k.split()[0] for k in lifecycle if " from " in k} >= {"resume", "validate", "test", "predict"}
    assert all(c["model flags"][f] for f in ("tied", "frozen", "never", "sometimes", "batchnorm", "groups"))
    assert len([k for k, v in c["optimizer"].items() if v]) >= 9
    assert {k for k, v in c["refused"].items() if v} >= {r[0] for r in REFUSED}
    assert {k.split()[0] for k, v in c["collectives"].items() if v} == {"flat", "hierarchical", "torus2d", "auto"}
    assert all(constrain(ex) == ex for ex in ci_examples())  # the fixed examples mean what they say


def test_shrinker_reduces_a_synthetic_failure_to_its_cause():
    """A failure that needs node_sharded + Adagrad + a checkpoint after fit, drawn inside a rich example, shrinks to
    exactly those on the simplest example, in a few batches."""
    ex = constrain({**draw(5, 4), "state": "node_sharded", "store": None, "save_after": True, "compression": None,
                    "optimizer": {"name": "Adagrad", "kwargs": {"lr": 0.1, "initial_accumulator_value": 0.1,
                                                                "lr_decay": 0.01}}})
    assert refusal(ex) is None and ex["state"] == "node_sharded"

    def cause(e: dict) -> bool:
        return e["state"] == "node_sharded" and e["optimizer"]["name"] == "Adagrad" and e["save_after"]

    batches: list[int] = []

    def fails(batch: list[dict]) -> list[bool]:
        batches.append(len(batch))
        return [cause(e) for e in batch]

    small, kept = shrink(ex, fails)
    expected = {**simplest(1, seed=ex["seed"]), "state": "node_sharded", "save_after": True,
                "optimizer": {"name": "Adagrad", "kwargs": {"lr": 0.1}}}
    assert small == expected, (small, kept)
    assert "fewer ranks" in kept and "SGD" not in kept
    assert len(batches) <= 12
    # an example that never fails is left as it is
    assert shrink(ex, lambda batch: [False] * len(batch)) == (ex, [])


@pytest.mark.parametrize("index", [i for i, r in enumerate(REFUSED) if r[3] == "construction"],
                         ids=lambda i: REFUSED[i][0])
def test_construction_refusal_names_both_options(index):
    """In this process, as the fit script constructs the strategy and the Trainer: no ranks needed."""
    from tests.differential.plan import spec
    from tests.scripts.differential_fit import strategy_of

    ex = refused_examples()[index]
    name, phrases, at = refusal(ex)
    assert (name, at) == (REFUSED[index][0], "construction")
    with pytest.raises(ValueError) as err:
        L.Trainer(accelerator="cpu", devices=ex["world"], strategy=strategy_of(spec("horizon", ex)), logger=False)
    assert all(p in str(err.value) for p in phrases), str(err.value)


# ---------------------------------------------------------------------------------------------- real ranks


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """Every CI example, the refused ones and the planted one, in one launch per world size."""
    work = tmp_path_factory.mktemp("differential")
    runner = Runner(work)
    # the refusals at construction are checked in this process (test_construction_refusal_names_both_options)
    examples = ci_examples() + [ex for ex, r in zip(refused_examples(), REFUSED) if r[3] != "construction"] \
        + [PLANTED]
    outcomes = evaluate(examples, runner)
    launches = ", ".join(f"{w} rank(s) x {n} fits: {s:.0f}s" for w, n, s in runner.timings)
    print(f"\ndifferential: {len(examples)} examples, {sum(len(o.plan.specs()) for o in outcomes)} fits ({launches})")
    yield runner, {key(o.ex): o for o in outcomes}
    if not os.environ.get("DIFFERENTIAL_KEEP"):
        shutil.rmtree(work, ignore_errors=True)


def _failure(o: Outcome, runner: Runner) -> str:
    return report(o, minimize(o, runner) if SHRINK else None)


@pytest.mark.parametrize("world, seed", [(w, s) for w, seeds in CI_SEEDS.items() for s in seeds],
                         ids=lambda v: str(v))
def test_example(world, seed, session):
    runner, outcomes = session
    o = outcomes[key(draw(seed, world))]
    print(f"{o.ex['seed']}/{world}: measured {o.measured}")
    assert not o.failed, _failure(o, runner)


@pytest.mark.parametrize("index", range(len(FIXED)), ids=lambda i: summary(constrain(FIXED[i])).replace(" ", "-"))
def test_fixed_example(index, session):
    runner, outcomes = session
    o = outcomes[key(constrain(FIXED[index]))]
    print(f"{summary(o.ex)}: measured {o.measured}")
    if index in KNOWN:  # fails against "ddp" only, as known (a fix makes this fail: then the entry goes)
        assert o.failed and all(c.startswith("ddp:") for c in signature(o.problems)), report(o)
        pytest.xfail(KNOWN[index])
    assert not o.failed, _failure(o, runner)


@pytest.mark.parametrize("index", [i for i, r in enumerate(REFUSED) if r[3] != "construction"],
                         ids=lambda i: REFUSED[i][0])
def test_refused_combination_raises_naming_both_sides(index, session):
    runner, outcomes = session
    o = outcomes[key(refused_examples()[index])]
    assert o.plan.refused is not None
    assert not o.failed, _failure(o, runner)


def test_planted_defect_is_caught_and_shrunk(session):
    """The tester can fail: a reference trained at a learning rate 1e-6 off is caught (float64, 1e-9), and the
    example shrinks to the simplest one with the plant (every dimension but the plant is irrelevant)."""
    runner, outcomes = session
    o = outcomes[key(PLANTED)]
    assert o.failed
    assert {"ddp:weights", "ddp:optimizer", "ddp:losses"} <= signature(o.problems), o.problems
    small, kept = minimize(o, runner)
    assert small.ex == {**simplest(1, seed=PLANTED["seed"]), "plant": True}, (small.ex, kept)
    assert small.failed and set(kept) >= {"no accumulation", "no schedule", "SGD", "no groups"}
    print(report(o, (small, kept)))


@pytest.mark.slow
@pytest.mark.timeout(0)  # hours; every launch has its own timeout against hangs
@pytest.mark.parametrize("world", [1, 2, 4])
def test_many_examples(world, tmp_path):
    n = int(os.environ.get("DIFFERENTIAL_EXAMPLES", "150"))
    examples = [draw(s, world) for s in range(1000, 1000 + n)]
    print("\n" + format_coverage(coverage(examples)))
    outcomes, reports = run_session(copy.deepcopy(examples), tmp_path, shrink_failures=SHRINK)
    shutil.rmtree(tmp_path, ignore_errors=True)
    assert not reports, f"{len(reports)} of {len(outcomes)} examples failed:\n" + "\n".join(reports)
