"""Node-sharded training state (``HorizonStrategy(state="node_sharded")``, lightning_horizon/node_state/).

Every multi-process case runs twice, node-sharded and replicated, with everything else equal, as
tests/scripts/composition_fit.py runs (real gloo ranks); the node-sharded run must give the
replicated run's weights and losses: equal to float64 rounding in ``64-true`` (where only the summation order
differs), within a small fraction of the weights' movement in fp32 / bf16. 1 node x 4 ranks and 2 emulated nodes x 2
ranks at world 4, 1 node x 2 at world 2; shard groups across nodes (``shard_group_nodes``) on 4 emulated nodes x 1
rank and 2 x 2, where the optimizer state per node is 1/k and the bytes each node sends are the model's
(``node_state.at_scale``). Checkpoints are full: they load into a plain module (``strict=True``), into
``state="replicated"``, into another number of ranks per node and another shard group, and resume exactly in the
same layout.

Against Lightning's own "ddp" (float64): a checkpoint saved after fit is the full one, an optimizer with eager state
(Adagrad) saves and resumes its owners' state, and every clip path clips by the whole gradient's norm.

Every fit of this file runs in three launches of tests/scripts/node_state_fit.py (fixture ``launched``): a process
start and ``import lightning`` cost seconds per rank.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_horizon import HorizonStrategy
from lightning_horizon.memory import training_memory
from lightning_horizon.node_state import PER_PARAMETER, NodeState, Owners, at_scale, plan_buckets, resolve_group_nodes
from lightning_horizon.node_state.optimizers import why_not
from lightning_horizon.node_state.checkpoint import local_part, merge, owned_optimizer_state
from lightning_horizon.parts import Part, Parts
from tests.launch import REPO, run_scripts
from tests.pairwise import all_pairs

STEPS, SAVE_AT = 4, 2


# ---------------------------------------------------------------------------------------------- no processes


def test_buckets_on_parameter_boundaries_balanced_by_bytes():
    params = [torch.zeros(n) for n in (100, 30, 30, 30, 10, 10, 400, 5)]
    buckets = plan_buckets(params, owners=3, cap_bytes=200)
    assert [p for b in buckets for p in b.params] == params[::-1]  # reverse order, every parameter once, whole
    assert all(b.nbytes <= 200 or len(b.params) == 1 for b in buckets)  # a larger parameter is a bucket of its own
    loads = [sum(b.nbytes for b in buckets if b.owner == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(b.nbytes for b in buckets)  # within one bucket (LPT)
    assert plan_buckets(params, 3, 200)[3].owner == buckets[3].owner  # the same plan on every rank


def test_buckets_one_dtype_each():
    params = [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)]
    assert [b.dtype for b in plan_buckets(params, 2, 1 << 20)] == [torch.float32, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("kwargs, names", [
    ({"state": "sharded"}, ("state='sharded'", "replicated", "node_sharded")),
    ({"collectives": "torus2d"}, ("collectives='torus2d'", "node_sharded")),
    ({"compression": "int8"}, ("compression='int8'", "node_sharded")),
    ({"sync_every": 4}, ("sync_every=4", "node_sharded")),
    ({"ddp_comm_hook": lambda s, b: None}, ("ddp_comm_hook=", "node_sharded")),
    ({"shard_group_nodes": 0}, ("shard_group_nodes=0", "'auto' or an int >= 1")),
    ({"shard_group_nodes": True}, ("shard_group_nodes=True", "'auto' or an int >= 1")),
    ({"shard_group_nodes": 2, "state": "replicated"}, ("shard_group_nodes=2", "state='node_sharded'")),
])
def test_refused_by_name(kwargs, names):
    with pytest.raises(ValueError) as err:
        HorizonStrategy(**{"state": "node_sharded", **kwargs})
    assert all(n in str(err.value) for n in names), str(err.value)


def test_shard_group_that_does_not_divide_the_nodes_is_refused_before_any_process_starts():
    import lightning as L

    with pytest.raises(ValueError, match=r"shard_group_nodes=3\) on 4 nodes: must divide the number of nodes; allowed"
                                         r" are \[1, 2, 4\] or 'auto'"):
        L.Trainer(accelerator="cpu", devices=4, logger=False,
                  strategy=HorizonStrategy(state="node_sharded", ranks_per_node=1, shard_group_nodes=3))


def test_shard_group_places_and_auto_size():
    """Shard groups are blocks of consecutive ranks: a rank's place is its rank modulo the block, the reducer of an
    owner's buckets is the owner's local rank on every node; "auto" is the largest divisor up to a quarter of the
    nodes."""
    o = Owners(ranks_per_node=2, nodes=2, rank=6)  # node 3, local rank 0: the second node of the second group
    assert (o.count, o.me, o.reducer(3), o.rank_of(3), o.rank_of(0)) == (4, 2, 1, 7, 4)
    assert [resolve_group_nodes("auto", n) for n in (1, 4, 7, 8, 12, 16, 18, 256)] == [1, 1, 1, 2, 3, 4, 3, 64]
    assert resolve_group_nodes(2, 4) == 2
    params = [torch.nn.Parameter(torch.zeros(64)) for _ in range(16)]
    loads = [sum(b.nbytes for b in plan_buckets(params, 8, 256) if b.owner == r) for r in range(8)]
    assert loads == [512] * 8  # 8 owners of a 2-node x 4-rank group, two parameters each


def test_model_at_scale_state_falls_with_the_group_and_traffic_stays_an_allreduce():
    n, w, rest = 10**6, 2, 14  # bf16-true with fp32 masters: weights 2 bytes, masters + grads + AdamW 14
    one = at_scale(n, w, rest, nodes=16, ranks_per_node=4, group_nodes=1)
    assert one["state"] == 16 * n and one["sent"] == pytest.approx(2 * 15 / 16 * 4 * n)  # DDP's ring allreduce
    four = at_scale(n, w, rest, nodes=16, ranks_per_node=4, group_nodes=4)
    assert four["state"] == w * n + rest * n / 4 and four["per_rank"] == four["state"] / 4
    # reduce 3/4, all-reduce across 4 groups of a quarter, broadcast 3/4 of the bf16 weights
    assert four["sent"] == pytest.approx(4 * n * 3 / 4 + 2 * 3 / 4 * 4 * n / 4 + 2 * n * 3 / 4)
    assert four["sent"] < one["sent"]  # bf16 weights back cost less than the fp32 sums they replace
    with pytest.raises(ValueError, match="group_nodes=3 must divide nodes=16"):
        at_scale(n, w, rest, nodes=16, ranks_per_node=4, group_nodes=3)


def test_optimizers_that_are_not_per_parameter_are_refused():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert [why_not(cls(p, lr=0.1)) for cls in (torch.optim.SGD, torch.optim.AdamW, torch.optim.Adagrad)] == [None] * 3
    assert "AdamW" in why_not(torch.optim.LBFGS(p))
    # as the part declares it, refused by the registry at setup, naming both
    parts = Parts()
    parts.add("node_state", type("Node", (Part,), {"label": NodeState.label, "refuses": lambda self, o: why_not(o)})())
    with pytest.raises(ValueError, match=r"^HorizonStrategy\(state='node_sharded'\) cannot step LBFGS: .*AdamW"):
        parts.check([torch.optim.LBFGS(p)])
    assert torch.optim.LBFGS not in PER_PARAMETER


def test_setup_memory_check_counts_this_ranks_share():
    """The fit check at setup (memory.training_memory) under node-sharded state: the weights are one copy for the
    node's ranks, the gradients and the optimizer state still to come are those of the parameters this rank owns."""
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(module.parameters())
    params = list(module.parameters())
    whole = training_memory(module, [opt])
    mine = set(map(id, params[:2]))  # the first layer's weight and bias
    share = training_memory(module, [opt], owns=lambda p: id(p) in mine, weights_shared_by=4)
    owned = sum(p.numel() * 4 for p in params[:2])
    assert (whole["gradients"], whole["optimizer_state"]) == (sum(p.numel() * 4 for p in params),
                                                             2 * sum(p.numel() * 4 for p in params))
    assert (share["gradients"], share["optimizer_state"]) == (owned, 2 * owned)
    assert share["parameters"] == whole["parameters"] // 4


def test_checkpoint_merge_takes_each_owners_entry():
    """Every rank's optimizer holds state for every parameter (Adagrad makes it in its constructor) and, after
    ``validate``, every rank has masters for all: a share holds its owner's entries only, and the merge is the
    owners' (stepped) state, whatever a non-owner holds."""
    a, b, c = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    owner = {a: 0, b: 1, c: 0}
    names = {"a": a, "b": b, "c": c}
    parts = []
    for rank in (0, 1):
        opt = torch.optim.Adagrad([a, b, c], lr=0.1)
        for p in (a, b, c):
            p.grad = torch.ones(2) if owner[p] == rank else None
        opt.step()
        ckpt = {"optimizer_states": [opt.state_dict()],
                "HorizonPrecision": {"masters": {n: torch.full((2,), float(rank)) for n in names}}}
        parts.append(local_part(ckpt, "HorizonPrecision", [opt], names, lambda p, r=rank: owner[p] == r))
    assert sorted(parts[0]["optimizer_states"][0]) == [0, 2] and sorted(parts[1]["optimizer_states"][0]) == [1]
    merged = {"optimizer_states": [{"state": {}, "param_groups": []}], "HorizonPrecision": {"masters": {}, "rng": {}}}
    merge(merged, parts, "HorizonPrecision")
    state = merged["optimizer_states"][0]["state"]
    assert sorted(state) == [0, 1, 2] and all(float(s["step"]) == 1 for s in state.values())
    masters = merged["HorizonPrecision"]["masters"]
    assert {n: float(m[0]) for n, m in masters.items()} == {"a": 0.0, "b": 1.0, "c": 0.0}
    assert merged["HorizonPrecision"]["rng"] == {}  # what is not per parameter stays as rank 0 wrote it


# ---------------------------------------------------------------------------------------------- real ranks

#: every valid pair of these values is one node-sharded run compared with its replicated twin (tests/pairwise.py)
DIMENSIONS = {
    "precision": ("64-true", "bf16-mixed", "bf16-true+fp32", "bf16-true+kahan"),
    # manual: two optimizers (SGD, AdamW) in one step; manual-twice: two synchronized backward passes before the step
    "optimization": ("automatic", "accumulate", "manual", "manual-twice"),
    "layout": ("1x4", "2x2", "1x2"),  # nodes x ranks per node
    "backoff": (False, True),  # GradNormBackoff; a NaN on the last rank at step 1, a spike on rank 0 at step 2
    "scheduler": (False, True),  # LambdaLR
    "sharding": (None, "forced"),  # activation recompute
    "model": ("gpt", "transformer", "tied", "generator", "batchnorm", "boring"),  # boring: Lightning's BoringModel
    "weights": ("shared", "copies"),  # node_weights: one copy per node in /dev/shm, or one per rank + broadcast
}
PRECISION = {"64-true": "64-true", "bf16-mixed": {"mode": "bf16-mixed", "compute": "fp32"},
             "bf16-true+fp32": {"mode": "bf16-true", "master": "fp32", "compute": "fp32"},
             "bf16-true+kahan": {"mode": "bf16-true", "master": "kahan", "compute": "fp32"}}
FP64, FP32 = "64-true", "32-true"
MIXED, TRUE_FP32, KAHAN = (PRECISION[k] for k in ("bf16-mixed", "bf16-true+fp32", "bf16-true+kahan"))


def valid(case: dict) -> bool:
    # Lightning steps no scheduler under manual optimization
    return not (str(case.get("optimization", "")).startswith("manual") and case.get("scheduler"))


def case_name(case: dict) -> str:
    named = {**case, "backoff": case["backoff"] and "backoff", "scheduler": case["scheduler"] and "scheduler",
             "sharding": case["sharding"] and "recompute", "weights": case["weights"] == "copies" and "copies"}
    return "-".join(str(named[d]) for d in DIMENSIONS if named[d])


# name: (model, optimization, world, ranks per node, precision, sharding, backoff, scheduler)
CASES: dict[str, tuple] = {}
EXTRA: dict[str, dict] = {"clip-bf16-mixed-1x2": {"gradient_clip_val": 0.05}}  # clipping by the norm over the shards
for _c in all_pairs(DIMENSIONS, valid):
    _nodes, _rpn = map(int, _c["layout"].split("x"))
    CASES[case_name(_c)] = (_c["model"], _c["optimization"], _nodes * _rpn, _rpn, PRECISION[_c["precision"]],
                            _c["sharding"], _c["backoff"], _c["scheduler"])
    if _c["weights"] == "copies":
        EXTRA[case_name(_c)] = {"node_weights": "copies"}
CASES["clip-bf16-mixed-1x2"] = ("gpt", "automatic", 2, 2, MIXED, None, False, False)
# shard groups across nodes: (case, shard_group_nodes, node_weights)
GROUP_CASES = {
    "groups2-64-true-4x1-backoff": (("gpt", "automatic", 4, 1, FP64, None, True, False), 2, "shared"),
    "groups4-64-true-4x1-manual-twice": (("tied", "manual-twice", 4, 1, FP64, None, False, False), 4, "shared"),
    "groups2-64-true-2x2-accumulate-copies": (("transformer", "accumulate", 4, 2, FP64, None, False, False), 2,
                                               "copies"),
    "groups4-bf16-true+fp32-4x1-scheduler": (("gpt", "automatic", 4, 1, TRUE_FP32, None, False, True), 4, "shared"),
    "groups2-bf16-true+kahan-2x2-recompute": (("generator", "automatic", 4, 2, KAHAN, "forced", True, False), 2,
                                              "shared"),
}
for _name, (_case, _k, _weights) in GROUP_CASES.items():
    CASES[_name] = _case
    EXTRA[_name] = {"shard_group_nodes": _k, **({"node_weights": _weights} if _weights != "shared" else {})}
# ||node-sharded - replicated|| / ||replicated - initial|| over the true weights. float64: rounding only; fp32
# gradients: sums in another order; bf16 gradients (bf16-true): rounded to bf16 at other points when two backward
# passes add up (measured 2.0e-3 with manual-twice); Kahan: also stochastic rounding draws in another order.
TOLERANCE = {FP64: 1e-9, "fp32": 1e-3, "bf16": 1e-2, "kahan": 2e-2}


def tolerance_key(precision: Any) -> str:
    if precision in (FP64, KAHAN):
        return FP64 if precision == FP64 else "kahan"
    return "bf16" if precision["mode"] == "bf16-true" else "fp32"


def run(name: str, model: str, optimization: str, world: int, rpn: int, precision: Any, sharding: Any,
        backoff: bool, scheduler: bool, state: str, state_checkpoint: str = "full", node_weights: str = "shared",
        shard_group_nodes: Any = "auto", **extra: Any) -> dict:
    strategy = {"state": state}
    if state == "node_sharded":
        strategy.update({k: v for k, v in (("state_checkpoint", state_checkpoint), ("node_weights", node_weights),
                                           ("shard_group_nodes", shard_group_nodes))
                         if v not in ("full", "shared", "auto")})
    return {"name": f"{name}-{state}", "model": model, "optimization": optimization, "world": world,
            "ranks_per_node": rpn, "precision": precision, "strategy": strategy, "sharding": sharding,
            "backoff": backoff, "scheduler": scheduler, "steps": STEPS, "epoch_steps": SAVE_AT, **extra}


def all_runs(work: Path) -> list[dict]:
    runs = [run(name, *case, state=state, **EXTRA.get(name, {}))
            for name, case in CASES.items() for state in ("node_sharded", "replicated")]
    # checkpoints: written node-sharded 1 x 4, resumed in the same layout, in another (2 x 2) and replicated
    # (in fp32: a 64-true fit does not resume bitwise even replicated, in this harness)
    saved = run("ckpt", "gpt", "automatic", 4, 4, FP32, None, False, False, "node_sharded", save_at=SAVE_AT)
    path = str(work / f"{saved['name']}.ckpt" / f"step={SAVE_AT}.ckpt")
    runs.append(saved)
    runs.append(run("ckpt", "gpt", "automatic", 4, 4, FP32, None, False, False, "replicated", save_at=SAVE_AT))
    for label, rpn, state in (("same", 4, "node_sharded"), ("other", 2, "node_sharded"), ("repl", 4, "replicated")):
        runs.append(run(f"resume-{label}", "gpt", "automatic", 4, rpn, FP32, None, False, False, state,
                        resume_from=path))
    # per-rank files (bf16-true + fp32 masters: optimizer state and masters in the files), resumed in another layout
    per_rank = run("ckpt-per-rank", "gpt", "automatic", 4, 4, TRUE_FP32, None, False, False, "node_sharded",
                   "per_rank", save_at=SAVE_AT)
    runs.append(per_rank)
    for label, rpn, state in (("other", 2, "node_sharded"), ("repl", 4, "replicated")):
        runs.append(run(f"resume-per-rank-{label}", "gpt", "automatic", 4, rpn, TRUE_FP32, None, False, False, state,
                        resume_from=str(work / f"{per_rank['name']}.ckpt" / f"step={SAVE_AT}.ckpt")))
    kahan = run("ckpt-kahan", "gpt", "automatic", 4, 4, KAHAN, None, False, False, "node_sharded", save_at=SAVE_AT)
    runs.append(kahan)
    runs.append(run("resume-kahan-same", "gpt", "automatic", 4, 4, KAHAN, None, False, False, "node_sharded",
                    resume_from=str(work / f"{kahan['name']}.ckpt" / f"step={SAVE_AT}.ckpt")))
    bf16 = run("ckpt-true-fp32", "gpt", "automatic", 4, 2, TRUE_FP32, None, False, False, "node_sharded",
               save_at=SAVE_AT)
    runs.append(bf16)
    runs.append(run("resume-true-fp32-same", "gpt", "automatic", 4, 2, TRUE_FP32, None, False, False,
                    "node_sharded", resume_from=str(work / f"{bf16['name']}.ckpt" / f"step={SAVE_AT}.ckpt")))
    # shard groups across nodes: per-rank files from 2 nodes x 2 in one group, resumed in the same layout, in
    # 4 nodes x 1 in one group and replicated; a full checkpoint from 4 nodes x 1 in groups of 2
    groups = run("ckpt-groups", "gpt", "automatic", 4, 2, TRUE_FP32, None, False, False, "node_sharded", "per_rank",
                 shard_group_nodes=2, save_at=SAVE_AT)
    runs.append(groups)
    path = str(work / f"{groups['name']}.ckpt" / f"step={SAVE_AT}.ckpt")
    for label, rpn, k, state in (("same", 2, 2, "node_sharded"), ("other", 1, 4, "node_sharded"),
                                 ("repl", 4, "auto", "replicated")):
        runs.append(run(f"resume-groups-{label}", "gpt", "automatic", 4, rpn, TRUE_FP32, None, False, False, state,
                        shard_group_nodes=k, resume_from=path))
    runs.append(run("ckpt-groups-full", "gpt", "automatic", 4, 1, FP32, None, False, False, "node_sharded",
                    shard_group_nodes=2, save_at=SAVE_AT))
    return runs


# ---------------------------------------------------------------------------------------------- the launches

FIT = REPO / "tests" / "scripts" / "node_state_fit.py"
# the memory test's fits: a fixed mmap threshold (glibc's moving one keeps freed blocks in the heap, which is the
# allocator's, not ours)
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
LAUNCH_TIMEOUT_S = {4: 900, 2: 600}  # hard: every process of a launch is killed then
#: the first test that needs ``launched`` waits for every launch (pytest-timeout counts fixture setup)
WAITS_FOR_LAUNCHES = pytest.mark.timeout(sum(LAUNCH_TIMEOUT_S.values()) + 120)
#: (name, world, the memory fit it begins with, composition runs, runs against ddp); the two world-4 launches run
#: at once, then the world-2 one
LAUNCHES = (("w4-composition", 4, "replicated", True, False), ("w4-ddp", 4, "node_sharded", False, True),
            ("w2", 2, None, True, True))


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """Every fit of this file, in the fewest processes: at world 4 two launches at once, each beginning with one of
    the memory test's fits while its processes are fresh (replicated, then the composition runs; node-sharded, then
    the runs against ddp); at world 2 one launch, the composition runs then the runs against ddp.

    Returns the folders and, per launch, its output if it failed (each fixture below checks the launches it reads).
    """
    work = tmp_path_factory.mktemp("node_state")
    dirs = {"composition": work / "composition", "ddp": work / "ddp",
            **{state: work / "memory" / state for state in ("replicated", "node_sharded")}}
    for d in dirs.values():
        d.mkdir(parents=True)
    composition, ddp = all_runs(dirs["composition"]), ddp_runs(dirs["ddp"])
    failed: dict[str, str] = {}
    for world in (4, 2):
        launches, names = [], []
        for name, w, memory, with_composition, with_ddp in LAUNCHES:
            if w != world:
                continue
            cfg = {"memory": memory and [memory, str(dirs[memory])], "composition": None,
                   "runs": [r for r in ddp if r["world"] == world] if with_ddp else []}
            if with_composition:  # in tests/scripts/composition_fit.py's format
                comp = work / f"{name}.composition.json"
                comp.write_text(json.dumps({"runs": [r for r in composition if r["world"] == world]}))
                cfg["composition"] = [str(comp), str(dirs["composition"])]
            (work / f"{name}.json").write_text(json.dumps(cfg))
            launches.append((FIT, [work / f"{name}.json", dirs["ddp"]], MEMORY_ENV if memory else None))
            names.append(name)
        for name, out in zip(names, run_scripts(launches, timeout=LAUNCH_TIMEOUT_S[world], check=False)):
            if out.returncode != 0:
                failed[name] = f"launch {name} exited {out.returncode}:\n{out.stdout[-6000:]}"
    return {**dirs, "failed": failed}


def launches_ok(launched: dict, composition: bool = False, ddp: bool = False) -> None:
    """The launches that hold the composition runs (or the runs against ddp) ended well."""
    mine = [name for name, _, _, c, d in LAUNCHES if (composition and c) or (ddp and d)]
    failed = [launched["failed"][name] for name in mine if name in launched["failed"]]
    assert not failed, "\n".join(failed)


@pytest.fixture(scope="module")
def results(launched) -> dict[str, list[dict]]:
    launches_ok(launched, composition=True)
    work = launched["composition"]
    runs = all_runs(work)
    loaded = {}
    for r in runs:
        loaded[r["name"]] = [torch.load(work / f"{r['name']}.rank{k}.pt", weights_only=False)
                             for k in range(r["world"])]
        for res in loaded[r["name"]]:
            if r.get("expect_error"):
                assert res["expected"], res["error"]
                continue
            assert res["error"] is None, f"{r['name']}: {res['error']}\n{res.get('traceback', '')}"
            assert not res["violations"], res["violations"]
    loaded["_work"] = work  # type: ignore[assignment]
    return loaded


def distance(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def deviation(w: dict, ref: dict, w0: dict) -> float:
    """||w - ref|| / ||ref - w0|| over all weights (as tests/test_composition.py measures)."""
    num = sum(float((w[k].double() - ref[k].double()).square().sum()) for k in ref)
    den = sum(float((ref[k].double() - w0[k].double()).square().sum()) for k in ref)
    return math.sqrt(num / max(den, 1e-60))


def true_weights(ranks: list[dict], node: int, rpn: int, group_nodes: int = 1) -> dict:
    """The true weights of one node: each parameter's from the rank holding its master / compensation (under
    node-sharded bf16-true only its owner does, somewhere in the node's shard group of ``group_nodes`` nodes), else
    the node's first rank's."""
    span = rpn * group_nodes
    first = node * rpn // span * span
    mine = ranks[first : first + span]
    out = dict(ranks[node * rpn]["final"])
    for r in mine:
        out.update({n: r["final"][n] for n in r.get("true_here", [])})
    return out


@WAITS_FOR_LAUNCHES
@pytest.mark.parametrize("name", list(CASES))
def test_same_result_as_replicated(results, name):
    sharded, replicated = results[f"{name}-node_sharded"], results[f"{name}-replicated"]
    _, _, world, rpn, precision, _, backoff, _ = CASES[name]
    tol = TOLERANCE[tolerance_key(precision)]
    group_nodes = EXTRA.get(name, {}).get("shard_group_nodes", 1)
    for node in range(world // rpn):
        ref = replicated[node * rpn]
        dev = deviation(true_weights(sharded, node, rpn, group_nodes), ref["final"], ref["initial"])
        assert dev <= tol, (node, dev)
    for rank, (s, r) in enumerate(zip(sharded, replicated)):
        assert s["global_step"] == r["global_step"]
        # what each rank's loss was, step by step (the forward reads the node's one copy of the weights)
        assert torch.allclose(torch.tensor(s["losses"]), torch.tensor(r["losses"]), rtol=10 * tol, atol=0,
                              equal_nan=True), rank
        if backoff:  # GradNormBackoff: the same skips, spikes and scale (the norm is summed over the shards)
            assert (s["skipped"], s["spikes"], s["lr_scale"]) == (r["skipped"], r["spikes"], r["lr_scale"])
            assert set(s["skipped"]) == {1} and set(s["spikes"]) == {1}  # one per optimizer
    # every rank reads the same weights: one copy per node, the same on every node; after fit each has its own
    for s in sharded[1:]:
        assert distance(s["params"], sharded[0]["params"]) == 0.0
    assert not any(s["shm_after_fit"] for s in sharded)


@WAITS_FOR_LAUNCHES
@pytest.mark.parametrize("name", list(GROUP_CASES))
def test_shard_groups_hold_a_kth_of_the_state_per_node_and_send_what_the_model_says(results, name):
    """Each shard group of k nodes holds one copy of the optimizer state, a k-th of it per node (against the whole
    copy per node of node-sharded state inside a node); the bytes the nodes sent in the last step are
    ``at_scale``'s (message sizes, the gradient's per-parameter flags aside)."""
    sharded, replicated = results[f"{name}-node_sharded"], results[f"{name}-replicated"]
    (_, optimization, world, rpn, precision, _, _, _), k, _ = GROUP_CASES[name]
    nodes, whole = world // rpn, replicated[0]["state_numel"]
    numel = sum(v.numel() for v in replicated[0]["final"].values())
    fp64 = precision == FP64
    model = at_scale(numel, 8 if fp64 else 2, 0, nodes, rpn, k, sum_bytes=8 if fp64 else 4)["sent"]
    counted = sum(r["comm"].get("comm/inter_bytes", 0) for r in sharded) / nodes
    assert counted == pytest.approx(model, rel=0.03), (counted, model)
    per_node = [sum(r["state_numel"] for r in sharded[i * rpn : (i + 1) * rpn]) for i in range(nodes)]
    print(name, "optimizer state per node / a whole copy:", [round(x / whole, 3) for x in per_node])
    for g in range(nodes // k):
        assert sum(per_node[g * k : (g + 1) * k]) == whole  # one copy per shard group, nothing twice
    if not optimization.startswith("manual"):
        # one optimizer, so state in proportion to the parameters owned: the owners' shares are even to one bucket
        # each (buckets of composition_fit.py's 0.004 MiB, or a larger parameter alone)
        width = 8 if fp64 else 2 if isinstance(precision, dict) and precision["mode"] == "bf16-true" else 4
        bucket = max(max(v.numel() for v in replicated[0]["final"].values()), int(0.004 * 2**20) // width)
        assert max(per_node) <= whole * (1 / k + rpn * bucket / numel)


@WAITS_FOR_LAUNCHES
def test_shard_group_checkpoints_resume_in_every_layout(results):
    """Per-rank files of a shard group of 2 nodes: one per rank of the group, resumed bitwise in the same layout and
    within fp32 rounding in another group size and replicated; a full checkpoint from groups is the replicated one."""
    work: Path = results["_work"]  # type: ignore[assignment]
    path = work / "ckpt-groups-node_sharded.ckpt" / f"step={SAVE_AT}.ckpt"
    assert torch.load(path, weights_only=False)["HorizonStrategy"]["state_files"] == 4
    assert sorted(p.name for p in Path(f"{path}.state").iterdir()) == [f"rank{i}.pt" for i in range(4)]
    whole = results["ckpt-groups-node_sharded"]
    truth = true_weights(whole, 0, 2, group_nodes=2)
    same = results["resume-groups-same-node_sharded"]
    assert distance(true_weights(same, 0, 2, group_nodes=2), truth) == 0.0
    assert same[0]["losses"] == whole[0]["losses"][SAVE_AT:]
    for resumed, rpn, k in ((results["resume-groups-other-node_sharded"], 1, 4),
                            (results["resume-groups-repl-replicated"], 4, 1)):
        for node in range(4 // rpn):
            dev = deviation(true_weights(resumed, node, rpn, k), truth, whole[0]["initial"])
            assert dev <= TOLERANCE["fp32"], (rpn, node, dev)
    full = torch.load(work / "ckpt-groups-full-node_sharded.ckpt" / f"step={SAVE_AT}.ckpt", weights_only=False)
    replicated = torch.load(work / "ckpt-replicated.ckpt" / f"step={SAVE_AT}.ckpt", weights_only=False)
    (f_opt,), (r_opt,) = full["optimizer_states"], replicated["optimizer_states"]
    assert sorted(f_opt["state"]) == sorted(r_opt["state"])
    for i, st in f_opt["state"].items():
        for key, value in st.items():
            assert torch.allclose(value, r_opt["state"][i][key], rtol=1e-3, atol=1e-5), (i, key)


@WAITS_FOR_LAUNCHES
def test_checkpoint_is_full_and_loads_into_a_plain_module(results):
    work: Path = results["_work"]  # type: ignore[assignment]
    sharded = torch.load(work / "ckpt-node_sharded.ckpt" / f"step={SAVE_AT}.ckpt", weights_only=False)
    replicated = torch.load(work / "ckpt-replicated.ckpt" / f"step={SAVE_AT}.ckpt", weights_only=False)
    assert sharded["state_dict"].keys() == replicated["state_dict"].keys()
    for k, v in sharded["state_dict"].items():
        assert torch.allclose(v, replicated["state_dict"][k], rtol=1e-4, atol=1e-6), k
    (s_opt,), (r_opt,) = sharded["optimizer_states"], replicated["optimizer_states"]
    assert sorted(s_opt["state"]) == sorted(r_opt["state"]) and s_opt["param_groups"] == r_opt["param_groups"]
    for i, st in s_opt["state"].items():
        for key, value in st.items():
            assert torch.allclose(value, r_opt["state"][i][key], rtol=1e-3, atol=1e-5), (i, key)
    import sys

    sys.path.insert(0, str(REPO))
    from tests.scripts.composition_models import build

    plain = build("gpt", "automatic")
    plain.load_state_dict(sharded["state_dict"], strict=True)


@WAITS_FOR_LAUNCHES
def test_per_rank_files_resume_in_another_layout(results):
    work: Path = results["_work"]  # type: ignore[assignment]
    path = work / "ckpt-per-rank-node_sharded.ckpt" / f"step={SAVE_AT}.ckpt"
    main = torch.load(path, weights_only=False)
    assert main["optimizer_states"][0]["state"] == {} and main["HorizonPrecision"]["masters"] == {}
    assert main["HorizonStrategy"]["state_files"] == 4
    files = sorted(p.name for p in Path(f"{path}.state").iterdir())
    assert files == [f"rank{i}.pt" for i in range(4)]  # nothing else left (no temporary file)
    shares = [torch.load(Path(f"{path}.state") / f, weights_only=False) for f in files]
    masters = [set(s["precision"]["masters"]) for s in shares]
    assert all(masters) and sum(map(len, masters)) == len(set().union(*masters))  # disjoint, every rank has some
    whole = results["ckpt-per-rank-node_sharded"]
    for label, rpn in (("other", 2), ("repl", 4)):
        resumed = results[f"resume-per-rank-{label}-{'replicated' if label == 'repl' else 'node_sharded'}"]
        for node in range(4 // rpn):
            dev = deviation(true_weights(resumed, node, rpn), true_weights(whole, 0, 4), whole[0]["initial"])
            assert dev <= TOLERANCE["fp32"], (label, node, dev)


@WAITS_FOR_LAUNCHES
def test_resume_exact_in_the_same_layout_and_equal_in_another(results):
    whole = results["ckpt-node_sharded"]
    same, other, repl = results["resume-same-node_sharded"], results["resume-other-node_sharded"], \
        results["resume-repl-replicated"]
    for rank in range(4):
        assert distance(same[rank]["final"], whole[rank]["final"]) == 0.0  # bitwise
        assert same[rank]["losses"] == whole[rank]["losses"][SAVE_AT:]
        # another number of ranks per node, or replicated: the same sums in another order (fp32)
        for resumed in (other, repl):
            assert deviation(resumed[rank]["final"], whole[rank]["final"], whole[rank]["initial"]) <= 1e-3
    bf16_whole, bf16_same = results["ckpt-true-fp32-node_sharded"], results["resume-true-fp32-same-node_sharded"]
    for node in range(2):  # every owner's fp32 masters came back
        assert distance(true_weights(bf16_same, node, 2), true_weights(bf16_whole, node, 2)) == 0.0
    # Kahan with stochastic rounding: compensations and each rank's own rounding generators came back
    kahan_whole, kahan_same = results["ckpt-kahan-node_sharded"], results["resume-kahan-same-node_sharded"]
    assert distance(true_weights(kahan_same, 0, 4), true_weights(kahan_whole, 0, 4)) == 0.0


@WAITS_FOR_LAUNCHES
def test_state_memory_per_rank_and_node_in_fresh_processes(launched):
    """Measured, not estimated: each rank's PSS growth from before the model exists to its peak in training (after
    backward, before and after the step). fp32 AdamW, 4 ranks: replicated holds ~16 B per parameter per rank plus
    DDP's buckets; node-sharded the weights once per node and a quarter of the rest per rank.

    Both fits at once, each the first fit of its own fresh processes (tests/scripts/node_state_memory.py's, at the
    start of the two world-4 launches): memory is what is measured, and it does not mind sharing cores."""
    growth = {}
    for state in ("replicated", "node_sharded"):
        files = [launched[state] / f"rank{r}.json" for r in range(4)]
        assert all(f.exists() for f in files), "\n".join(launched["failed"].values()) or f"{state}: no result"
        rows = [json.loads(f.read_text()) for f in files]
        growth[state] = [r["peak_pss"] - r["base"] for r in rows]
    params = 48 * (256 * 256 + 256)
    print({k: [round(g / 2**20, 1) for g in v] for k, v in growth.items()}, f"params {params * 4 / 2**20:.1f} MiB")
    replicated, sharded = sum(growth["replicated"]), sum(growth["node_sharded"])
    assert replicated >= 0.8 * 4 * 16 * params  # the replicated figure is real: everything on every rank
    assert max(growth["node_sharded"]) < min(growth["replicated"])
    assert sharded <= 0.4 * replicated, (sharded / 2**20, replicated / 2**20)


# ---------------------------------------------------------------------------------------------- against Lightning's ddp

FIT_STEPS, MORE = 4, 3  # a fit of FIT_STEPS (one epoch), then resumed for MORE steps
FP64_TRUE = "64-true"
BF16_FP32_MASTER = {"mode": "bf16-true", "master": "fp32", "compute": "fp32"}


def ns(rpn: int) -> dict:
    return {"state": "node_sharded", "ranks_per_node": rpn}


def fit_run(name: str, world: int, strategy: Any, optimizer: str = "AdamW", precision: Any = FP64_TRUE,
            **extra: Any) -> dict:
    return {"name": name, "world": world, "strategy": strategy, "optimizer": optimizer, "precision": precision,
            "steps": FIT_STEPS, **extra}


def resumed(name: str, world: int, strategy: Any, optimizer: str, work: Path, source: str) -> dict:
    return fit_run(name, world, strategy, optimizer, steps=FIT_STEPS + MORE, epoch_steps=FIT_STEPS,
                   resume_from=str(work / source / "after.ckpt"))


def ddp_runs(work: Path) -> list[dict]:
    runs = [
        # world 4: checkpoints saved after fit (2 nodes x 2, 1 x 4; fp64 AdamW, bf16-true fp32 masters), resumed by ddp
        fit_run("ddp-adamw", 4, "ddp"),
        fit_run("ns22-adamw", 4, ns(2), after_fit=True),
        fit_run("ns14-adamw", 4, ns(4)),
        fit_run("ns22-bf16", 4, ns(2), precision=BF16_FP32_MASTER, after_fit=True),
        *(resumed(f"ddp-from-{src}", 4, "ddp", "AdamW", work, src) for src in ("ddp-adamw", "ns22-adamw",
                                                                                 "ns14-adamw")),
        # across nodes: self.clip_gradients in configure_gradient_clipping
        fit_run("ddp4-configure", 4, "ddp", "SGD", clip="configure"),
        fit_run("ns22-configure", 4, ns(2), "SGD", clip="configure"),
        # world 2: Adagrad (optimizer state for every parameter from its constructor on)
        fit_run("ddp-adagrad", 2, "ddp", "Adagrad"),
        fit_run("ns-adagrad", 2, ns(2), "Adagrad"),
        *(resumed(f"{s}-from-{src}", 2, strategy, "Adagrad", work, src)
          for s, strategy, src in (("ddp", "ddp", "ddp-adagrad"), ("ddp", "ddp", "ns-adagrad"),
                                   ("ns", ns(2), "ns-adagrad"))),
        # every clip path (SGD: a clipped gradient is a different step), against ddp clipping the same way
        fit_run("ddp-sgd", 2, "ddp", "SGD"),
        fit_run("ddp-norm", 2, "ddp", "SGD", clip="trainer-norm"),
        fit_run("ns-trainer-norm", 2, ns(2), "SGD", clip="trainer-norm"),
        fit_run("ns-configure", 2, ns(2), "SGD", clip="configure"),
        fit_run("ddp-value", 2, "ddp", "SGD", clip="trainer-value"),
        fit_run("ns-trainer-value", 2, ns(2), "SGD", clip="trainer-value"),
        fit_run("ddp-manual", 2, "ddp", "SGD", manual=True, clip="manual"),
        fit_run("ns-manual", 2, ns(2), "SGD", manual=True, clip="manual"),
        fit_run("ns-manual-torch", 2, ns(2), "SGD", manual=True, clip="manual-torch"),
        # one bucket (1 MiB): rank 0 owns every gradient, rank 1 none; clipping there is a no-op, on every path
        *(fit_run(f"ns-{clip}-one-owner", 2, {**ns(2), "bucket_size_mb": 1.0}, "SGD", clip=clip)
          for clip in ("trainer-value", "configure-value", "trainer-norm", "configure")),
    ]
    return runs


@pytest.fixture(scope="module")
def vs_ddp(launched) -> dict:
    launches_ok(launched, ddp=True)
    work = launched["ddp"]
    runs = ddp_runs(work)
    loaded: dict = {"_work": work}
    for r in runs:
        loaded[r["name"]] = [torch.load(work / f"{r['name']}.rank{k}.pt", weights_only=False)
                             for k in range(r["world"])]
    return loaded


def ok(results: dict, name: str) -> list[dict]:
    ranks = results[name]
    for res in ranks:
        assert res["error"] is None, f"{name}: {res['error']}\n{res.get('traceback', '')[-3000:]}"
    return ranks


def ckpt(results: dict, name: str, which: str = "after") -> dict:
    return torch.load(results["_work"] / name / f"{which}.ckpt", weights_only=False)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_same_state(a: dict, b: dict, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Two optimizer ``state`` dicts: the same parameters, the same keys, values within rtol/atol (0: bitwise)."""
    assert sorted(a) == sorted(b)
    for i in a:
        assert sorted(a[i]) == sorted(b[i]), i
        for key, value in a[i].items():
            assert torch.allclose(value.double(), b[i][key].double(), rtol=rtol, atol=atol), (i, key, value,
                                                                                               b[i][key])


@WAITS_FOR_LAUNCHES
def test_comm_monitor_logs_the_owners_traffic(vs_ddp):
    """CommMonitor under node-sharded state logs what every rank sent its owners (and, on 2 nodes, across them)
    and how long it waited; under Lightning's DDP, which counts nothing, it logs nothing."""
    for name, inter in (("ns22-adamw", True), ("ns-adagrad", False), ("ns-manual", False)):
        comm = ok(vs_ddp, name)[0]["comm"]
        assert comm["comm/intra_bytes"] > 0 and comm["comm/seconds"] > 0 and comm["comm/calls"] > 0, (name, comm)
        assert (comm["comm/inter_bytes"] > 0) == inter, (name, comm)
        assert 0 < comm["comm/time_share"] < 1
    assert ok(vs_ddp, "ddp-adamw")[0]["comm"] == {}


@WAITS_FOR_LAUNCHES
def test_checkpoint_saved_after_fit_is_full(vs_ddp):
    """trainer.save_checkpoint after fit (2 nodes x 2 and 1 x 4) holds every parameter's optimizer state and, under
    bf16-true, every fp32 master: the checkpoint ModelCheckpoint wrote at the fit's last step, and ddp's."""
    ok(vs_ddp, "ddp-adamw")
    ddp = ckpt(vs_ddp, "ddp-adamw")["optimizer_states"][0]["state"]
    assert len(ddp) == 8
    for name in ("ns22-adamw", "ns14-adamw"):
        held = [set(r["opt_state"]) for r in ok(vs_ddp, name)[:2 if name == "ns22-adamw" else 4]]  # node 0's
        assert all(held) and sum(map(len, held)) == len(set().union(*held)) == 8, held  # every rank owns a share
        after = ckpt(vs_ddp, name)["optimizer_states"][0]["state"]
        assert_same_state(after, ckpt(vs_ddp, name, "end")["optimizer_states"][0]["state"])
        assert_same_state(after, ddp, rtol=1e-9, atol=1e-12)
    # validate, test and predict after fit run, and a checkpoint saved after them is still the full one
    for rank in ok(vs_ddp, "ns22-adamw"):
        assert rank["evaluated"]["validate"][0]["val_loss"] > 0 and rank["evaluated"]["predict"] > 0
    assert_same_state(ckpt(vs_ddp, "ns22-adamw", "after-eval")["optimizer_states"][0]["state"], ddp,
                      rtol=1e-9, atol=1e-12)
    ok(vs_ddp, "ns22-bf16")
    end = ckpt(vs_ddp, "ns22-bf16", "end")
    names = [n for n in end["state_dict"]]
    for which in ("after", "after-eval"):
        saved = ckpt(vs_ddp, "ns22-bf16", which)
        masters = saved["HorizonPrecision"]["masters"]
        assert sorted(masters) == sorted(names), which
        for n in names:
            assert torch.equal(masters[n], end["HorizonPrecision"]["masters"][n]), (which, n)
        assert_same_state(saved["optimizer_states"][0]["state"], end["optimizer_states"][0]["state"])
        assert saved["HorizonStrategy"]["ranks"] and all("node_state" in r for r in saved["HorizonStrategy"]["ranks"])
    # plain ddp resumed from them ends where ddp resumed from its own checkpoint ends
    reference = ok(vs_ddp, "ddp-from-ddp-adamw")[0]["final"]
    for src in ("ns22-adamw", "ns14-adamw"):
        assert max_diff(ok(vs_ddp, f"ddp-from-{src}")[0]["final"], reference) <= 1e-9, src


@WAITS_FOR_LAUNCHES
def test_eager_optimizer_state_only_the_owners_counts(vs_ddp):
    """Adagrad creates state for every parameter in its constructor: the checkpoint holds each owner's (not a
    non-owner's never-stepped entry), and resuming, ddp or node-sharded, ends where ddp does."""
    ddp = ckpt(vs_ddp, "ddp-adagrad")["optimizer_states"][0]["state"]
    ok(vs_ddp, "ns-adagrad")
    assert max_diff(vs_ddp["ns-adagrad"][0]["final"], ok(vs_ddp, "ddp-adagrad")[0]["final"]) <= 1e-9
    for which in ("end", "after"):
        state = ckpt(vs_ddp, "ns-adagrad", which)["optimizer_states"][0]["state"]
        assert all(float(s["step"]) == FIT_STEPS for s in state.values())
        assert_same_state(state, ddp, rtol=1e-9, atol=1e-12)
    # a rank keeps the state of what it owns only: the eager state of the others is dropped at setup
    held = [set(r["opt_state"]) for r in vs_ddp["ns-adagrad"]]
    assert held[0] and held[1] and not held[0] & held[1] and len(held[0] | held[1]) == 8
    reference = ok(vs_ddp, "ddp-from-ddp-adagrad")[0]["final"]
    for name in ("ddp-from-ns-adagrad", "ns-from-ns-adagrad"):
        for rank in ok(vs_ddp, name):
            assert max_diff(rank["final"], reference) <= 1e-9, name


@WAITS_FOR_LAUNCHES
@pytest.mark.parametrize("sharded, reference", [
    ("ns-trainer-norm", "ddp-norm"),  # Trainer(gradient_clip_val=...), any precision plugin
    ("ns-configure", "ddp-norm"),  # self.clip_gradients(...) in configure_gradient_clipping: the same clip
    ("ns22-configure", "ddp4-configure"),  # 2 nodes x 2
    ("ns-trainer-value", "ddp-value"),
    ("ns-manual", "ddp-manual"),  # self.clip_gradients in manual optimization
    # a rank that holds none of the gradients (one bucket, owned by rank 0)
    ("ns-trainer-value-one-owner", "ddp-value"),
    ("ns-configure-value-one-owner", "ddp-value"),  # self.clip_gradients(..., "value") in configure_gradient_clipping
    ("ns-trainer-norm-one-owner", "ddp-norm"),
    ("ns-configure-one-owner", "ddp-norm"),
])
def test_every_clip_path_clips_by_the_global_norm(vs_ddp, sharded, reference):
    ref = ok(vs_ddp, reference)[0]["final"]
    if len(vs_ddp[reference]) == 2:
        assert max_diff(ref, ok(vs_ddp, "ddp-sgd")[0]["final"]) > 1e-3  # the reference did clip
    ranks = ok(vs_ddp, sharded)
    if sharded.endswith("one-owner"):
        assert [r["held"] for r in ranks] == [8, 0]  # the case it names: rank 1 has no gradient to clip
    for rank in ranks:
        assert max_diff(rank["final"], ref) <= 1e-9


@WAITS_FOR_LAUNCHES
def test_clipping_the_share_with_torch_directly_is_warned_by_name(vs_ddp):
    warned = [w for r in ok(vs_ddp, "ns-manual-torch") for w in r["warnings"] if "clip_grad_norm_" in w]
    assert warned and "self.clip_gradients" in warned[0], warned
    assert not any("clip_grad_norm_" in w for r in ok(vs_ddp, "ns-manual") for w in r["warnings"])
