"""The space the differential tester draws from: ``draw(seed, world)`` is one example, a JSON-able dict of choices.

An example is what a user writes (a LightningModule's habits, an optimizer and a schedule, a lifecycle of
checkpoints, resumes and evaluations) and how it is trained (HorizonStrategy + precision). ``constrain`` makes the
choices mean something together (generator constraints: values that are meaningless together are never drawn);
``refusal`` says whether the library refuses the example by design (``REFUSED``: such an example must raise at
construction or setup, naming both options). docs/composition.md ("The differential tester") has the tables.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any, Callable, Optional

# ------------------------------------------------------------------------------------------------ the choices

MODEL_KINDS = ("zoo", "transformer", "boring")  # zoo: ours (tokens, blocks); Lightning's demo Transformer, BoringModel
#: "bag": a ShardedEmbeddingBag beside the zoo's token embedding (SparseSGD at its parameter group's lr; "ddp" trains
#: a dense nn.EmbeddingBag in its place, tests/differential/models.py); True spreads it over the world, "node" over
#: each node's ranks (a copy per node), "auto" lets its first lookup choose (with the example's cost model);
#: "bag_weights": the bag's per_sample_weights come from a parameter (a learned weight per token id), so their
#: gradient comes back from the rows' owners; "bag_disk": the bag's rows on disk (rows_on_disk, a cache smaller than
#: a rank's rows: evictions between steps), a table of token pairs;
#: "compile": the network's blocks (the whole network for the demo models) under torch.compile, a counting backend
#: that runs dynamo's graphs eagerly (no inductor: the same bits), and the fit must run them
MODEL_FLAGS = ("tied", "frozen", "never", "sometimes", "batchnorm", "dropout", "groups", "bag", "compile",
               "bag_weights", "bag_disk")

#: torch.optim, every class with state a user would pick, each with the variants that change its state or arithmetic
OPTIMIZERS: dict[str, list[dict]] = {
    "SGD": [{"lr": 0.1}, {"lr": 0.1, "momentum": 0.9}, {"lr": 0.05, "momentum": 0.9, "nesterov": True,
            "weight_decay": 0.01}, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1}, {"lr": 0.1, "momentum": 0.9,
                                                                                  "fused": True}],
    "Adam": [{"lr": 1e-2}, {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.01}, {"lr": 1e-2, "foreach": True},
             {"lr": 1e-2, "fused": True}],
    "AdamW": [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 1e-2, "amsgrad": True}, {"lr": 1e-2, "fused": True}],
    "Adamax": [{"lr": 2e-2}, {"lr": 2e-2, "weight_decay": 0.01}],
    "Adagrad": [{"lr": 0.1}, {"lr": 0.1, "initial_accumulator_value": 0.1, "lr_decay": 0.01}],
    "Adadelta": [{"lr": 1.0}, {"lr": 1.0, "rho": 0.8, "weight_decay": 0.01}],
    "RMSprop": [{"lr": 1e-2}, {"lr": 1e-2, "centered": True, "momentum": 0.9}],
    "Rprop": [{"lr": 1e-2}],
    "NAdam": [{"lr": 1e-2}, {"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.01}],
    "RAdam": [{"lr": 1e-2}, {"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.01}],
    "ASGD": [{"lr": 1e-2, "t0": 1}],
    "Adafactor": [{"lr": 1e-2}],
    "LBFGS": [{"lr": 0.5, "max_iter": 3, "history_size": 4}],
    "UserAdam": [{"lr": 1e-2}],  # a user's subclass of Adam (tests/differential/models.py)
}
SECOND_OPTIMIZERS = {"SGD": {"lr": 0.1, "momentum": 0.9}, "AdamW": {"lr": 1e-2, "weight_decay": 0.01}}
SCHEDULERS = (None, "StepLR", "LambdaLR", "OneCycleLR", "CosineAnnealingLR", "ExponentialLR", "LinearLR",
              "MultiStepLR", "CosineAnnealingWarmRestarts", "CyclicLR", "ReduceLROnPlateau")
PRECISIONS = ("64-true", "32-true", "bf16-mixed", "bf16-true+fp32", "bf16-true+kahan")
STORE_STEPS = ("auto", "in_backward", "after_backward")
EVAL_KINDS = ("validate", "test", "predict")
#: where a resumed fit runs: as the fit that wrote the checkpoint, on one rank, replicated (from node_sharded), in RAM
#: (from a store)
RESUME_LAYOUTS = ("same", "world1", "replicated", "ram")
EPOCH_STEPS = 2  # training steps per epoch: the mid-fit checkpoint at step 2 is an epoch boundary
#: where the mid-fit checkpoint is written (``ckpt_at``, optimizer steps): the first epoch's end, or in the middle of
#: the first or second epoch; a resume from it continues at the epoch's next batch (data_position.py)
CKPT_STEPS = {EPOCH_STEPS: 2, 1: 1, EPOCH_STEPS + 1: 1}
#: a resume into another world size with the same global batch (``resume["layout"] = "regrid"``): world -> worlds
REGRID_WORLDS = {1: (2,), 2: (1, 4), 4: (2,)}
COLLECTIVES = ("flat", "hierarchical", "torus2d", "auto")
#: torus2d's grids at 2 nodes x 2 (None: rows are nodes, the hierarchical groups; (4, 1): one row across both
#: nodes; (1, 4): one column of every rank)
TORUS_SHAPES = (None, [4, 1], [1, 4])
#: link constants for "auto" instead of its probe (a probe's timing would make the choice, so the bits, vary):
#: "slow": a slow inter-node link (two-level algorithms win), "fast": links of one speed (flat wins small buckets)
COST_MODELS = {"slow": {"intra": [1e-6, 1e-10], "inter": [1e-4, 1e-8]},
               "fast": {"intra": [1e-5, 1e-9], "inter": [1e-5, 1e-9]}}
COMPRESSIONS = (None, "bf16", "int8")
#: local SGD's periods: 2 ends every fit of 2 or 4 steps right after an average, 3 between two averages
SYNC_EVERY = (1, 2, 3)


#: optimizers whose step does not shrink with the gradient: Rprop steps by its sign, Adafactor normalizes it by its
#: own running RMS with an epsilon of (float eps)^2 (and Adagrad from a zero accumulator, with an epsilon of 1e-10)
NOISE_TO_STEP = ("Rprop", "Adafactor")


def _pick(rng: random.Random, weighted: dict) -> Any:
    values = list(weighted)
    return values[rng.choices(range(len(values)), weights=list(weighted.values()))[0]]


def draw(seed: int, world: int) -> dict:
    """The example of ``seed`` at ``world`` ranks: deterministic (``random.Random`` seeded by a string)."""
    rng = random.Random(f"differential-{seed}-{world}")
    coin = lambda p: rng.random() < p  # noqa: E731
    rpn = {1: 1, 2: _pick(rng, {1: 1, 2: 2}), 4: _pick(rng, {2: 3, 4: 1})}[world]
    kind = _pick(rng, {"zoo": 6, "transformer": 2, "boring": 1})
    model = {"kind": kind, **{f: coin(p) for f, p in (("tied", 0.35), ("frozen", 0.3), ("never", 0.3),
                                                       ("sometimes", 0.3), ("batchnorm", 0.3), ("dropout", 0.3),
                                                       ("groups", 0.35))}}
    name = rng.choice(list(OPTIMIZERS))
    optimization = _pick(rng, {"automatic": 4, "manual": 1})
    ex: dict = {
        "seed": seed,
        "world": world,
        "rpn": rpn,
        "model": model,
        "optimizer": {"name": name, "kwargs": rng.choice(OPTIMIZERS[name])},
        "second": rng.choice(list(SECOND_OPTIMIZERS)),  # manual optimization's second optimizer
        "scheduler": ({"name": s, "interval": rng.choice(("step", "epoch"))}
                      if (s := rng.choice(SCHEDULERS)) is not None and coin(0.7) else None),
        "optimization": optimization,
        "accumulate": _pick(rng, {1: 3, 2: 2}),
        "clip": ({"where": rng.choice(("trainer", "hook", "manual")), "algorithm": _pick(rng, {"norm": 3, "value": 1}),
                  "value": rng.choice((0.05, 1e3))} if coin(0.4) else None),
        "skip_batch": rng.choice((0, 1)) if coin(0.15) else None,
        "validate": coin(0.3),
        "ckpt_during": coin(0.5),
        "save_after": coin(0.5),
        "resume": ({"from": rng.choice(("during", "after")), "layout": rng.choice(RESUME_LAYOUTS)}
                   if coin(0.45) else None),
        "eval": {"kind": rng.choice(EVAL_KINDS), "from": rng.choice(("during", "after"))} if coin(0.3) else None,
        "state": _pick(rng, {"replicated": 1, "node_sharded": 1}) if rpn > 1 else _pick(rng, {"replicated": 9,
                                                                                             "node_sharded": 1}),
        "store": ({"step": rng.choice(STORE_STEPS), "prefetch": rng.choice(("read", "readahead", "none"))}
                  if coin(0.3) else None),
        "sharding": _pick(rng, {None: 6, "auto": 1, "forced": 2}),
        # 512 B: several buckets (owners) even for a tiny model; 1 MiB: one bucket, all of it on one owner
        "bucket_mb": _pick(rng, {0.0005: 3, 1.0: 1}),
        "backoff": {"max_norm": rng.choice((0.05, 10.0, None))} if coin(0.25) else None,
        "precision": _pick(rng, {"64-true": 5, "32-true": 2, "bf16-mixed": 1, "bf16-true+fp32": 1,
                                 "bf16-true+kahan": 1}),
        "steps": _pick(rng, {4: 4, 2: 1}),
    }
    keep_refused = coin(0.25)
    # drawn last, so that adding them left every earlier choice of a seed as it was
    nodes = world // rpn
    ex["collectives"] = _pick(rng, {"flat": 3, "hierarchical": 2, "torus2d": 2, "auto": 2}) \
        if (world == 4 and rpn == 2) else "flat"
    ex["torus_shape"] = rng.choice(TORUS_SHAPES)
    ex["cost_model"] = rng.choice(list(COST_MODELS))
    ex["compression"] = _pick(rng, {None: 3, "bf16": 1, "int8": 1}) if world > 1 else None
    ex["sync_every"] = _pick(rng, {1: 3, 2: 2, 3: 1}) if nodes == 2 else 1
    # node_sharded's shard group: the nodes that hold one copy of the state together (a divisor of the nodes)
    ex["shard_nodes"] = rng.choice([d for d in range(1, nodes + 1) if nodes % d == 0])
    # local SGD's sync: the plain average or DiLoCo's Nesterov outer step, blocking or overlapped with the next period
    ex["outer"] = rng.choice(("average", "nesterov"))
    ex["overlap"] = coin(0.5)
    bag, span = coin(0.25), rng.choice((True, "node", "auto"))  # span="world", "node" (a copy per node), "auto"
    ex["model"]["bag"] = span if bag else False
    ex["model"]["compile"] = coin(0.15)
    ex["model"]["bag_weights"] = coin(0.5)
    ex["model"]["bag_disk"] = coin(0.4)
    ex["ckpt_at"] = _pick(rng, CKPT_STEPS)
    new_world = rng.choice(REGRID_WORLDS[world])
    if ex["resume"] is not None and coin(0.3):
        ex["resume"].update(layout="regrid", world=new_world, rpn=rng.choice({1: [1], 2: [1, 2], 4: [2]}[new_world]))
    ex = constrain(ex)
    if refusal(ex) is not None and not keep_refused:
        ex = unrefuse(ex)
    return ex


def simplest(world: int = 1, seed: int = 0) -> dict:
    """The example every dimension of which is at its simplest value (where shrinking ends)."""
    return {"seed": seed, "world": world, "rpn": 1,
            "model": {"kind": "zoo", **{f: False for f in MODEL_FLAGS}},
            "optimizer": {"name": "SGD", "kwargs": OPTIMIZERS["SGD"][0]}, "second": "SGD", "scheduler": None,
            "optimization": "automatic", "accumulate": 1, "clip": None, "skip_batch": None, "validate": False,
            "ckpt_during": False, "save_after": False, "resume": None, "eval": None, "state": "replicated",
            "store": None, "sharding": None, "collectives": "flat", "bucket_mb": 1.0, "backoff": None,
            "precision": "64-true", "steps": 2, "torus_shape": None, "cost_model": None, "compression": None,
            "sync_every": 1, "shard_nodes": 1, "outer": "average", "overlap": False, "ckpt_at": EPOCH_STEPS}


def refused_examples() -> list[dict]:
    """One example per entry of ``REFUSED``, on top of the simplest one."""
    base = simplest()
    sharded = {"world": 2, "rpn": 2, "state": "node_sharded", "bucket_mb": 0.0005}
    nodes2 = {"world": 2, "rpn": 1, "bucket_mb": 0.0005}  # 2 nodes x 1
    bag = {**base["model"], "bag": True}
    out = [
        {**base, **nodes2, "compression": "int8", "sync_every": 2},
        {**base, "world": 4, "rpn": 2, "bucket_mb": 0.0005, "state": "node_sharded", "collectives": "torus2d"},
        {**base, **sharded, "compression": "bf16"},
        {**base, **nodes2, "state": "node_sharded", "sync_every": 2},
        {**base, **sharded, "store": {"step": "auto", "prefetch": "read"}},
        {**base, "world": 4, "rpn": 2, "bucket_mb": 0.0005, "collectives": "torus2d", "torus_shape": [4, 1],
         "compression": "int8"},
        {**base, **nodes2, "sync_every": 2, "model": bag},
        {**base, "store": {"step": "auto", "prefetch": "read"}, "model": bag},
        {**base, **sharded, "model": bag},
        {**base, "precision": "bf16-true+kahan", "model": bag},
        {**base, **sharded, "optimizer": {"name": "LBFGS", "kwargs": OPTIMIZERS["LBFGS"][0]}},
        {**base, "optimizer": {"name": "LBFGS", "kwargs": OPTIMIZERS["LBFGS"][0]}, "precision": "bf16-true+fp32",
         "sharding": "auto"},
        {**base, "optimizer": {"name": "LBFGS", "kwargs": OPTIMIZERS["LBFGS"][0]}, "store": {"step": "auto",
                                                                                          "prefetch": "read"}},
        {**base, "store": {"step": "in_backward", "prefetch": "read"}, "backoff": {"max_norm": 1.0}},
    ]
    assert [refusal(ex)[0] for ex in out] == [r[0] for r in REFUSED]
    return out


# ------------------------------------------------------------------------------------------------ constraints


def constrain(ex: dict) -> dict:
    """Make the choices mean something together (deterministic; applied again after every shrinking step).

    These are not refusals: a value that cannot matter (hierarchical collectives on one node), a combination that
    Lightning itself refuses (gradient accumulation or Trainer clipping under manual optimization), or one without a
    promise to compare against (each rule says which).
    """
    ex = copy.deepcopy(ex)
    m = ex["model"]
    world, rpn = ex["world"], ex["rpn"]
    ex["rpn"] = rpn = min(rpn, world)
    if ex["state"] != "node_sharded" or (world // rpn) % ex["shard_nodes"]:
        ex["shard_nodes"] = 1  # a shard group is node_sharded's, of a divisor of the nodes
    if ex["collectives"] != "flat" and not (world == 4 and rpn == 2):
        ex["collectives"] = "flat"  # hierarchical, torus2d and auto need 2 nodes of 2 ranks
    if ex["collectives"] != "torus2d":
        ex["torus_shape"] = None  # torus2d's option
    if world == 1:
        ex["compression"] = None  # compression needs several ranks
    if world // rpn != 2:
        ex["sync_every"] = 1  # local SGD needs 2 nodes
    if m["kind"] != "zoo":
        m["tied"] = m["batchnorm"] = False  # the demo models have no such layers
    if m["kind"] == "boring":
        m["dropout"] = False
    name = ex["optimizer"]["name"]
    if ex["optimization"] == "manual":
        ex["accumulate"] = 1  # Lightning: no automatic accumulation under manual optimization
        ex["skip_batch"] = None  # a skipped batch is automatic optimization's
        if ex["clip"] and ex["clip"]["where"] != "manual":
            ex["clip"]["where"] = "manual"  # Lightning: no Trainer clipping under manual optimization
        if name == "LBFGS":
            ex["optimizer"] = {"name": "SGD", "kwargs": OPTIMIZERS["SGD"][1]}  # LBFGS needs Lightning's closure
    elif ex["clip"] and ex["clip"]["where"] == "manual":
        ex["clip"]["where"] = "hook"
    if ex["optimizer"]["name"] == "LBFGS":
        ex["skip_batch"] = None  # LBFGS needs a loss from every closure
        if world > 2:
            # gloo sums a bucket in chunks, so at 3 ranks and more the bucket size sets each element's summation
            # order; LBFGS (with a strong clip) grows that float64 rounding past the reference's 1e-9 within 2-4
            # steps (measured: 1e-10 -> 1e-5). With "ddp"'s bucket size such a fit is its bits (deviation 0)
            ex["bucket_mb"] = 1.0
    o = ex["optimizer"]
    noise_to_step = o["name"] in NOISE_TO_STEP or (o["name"] == "Adagrad" and not o["kwargs"].get(
        "initial_accumulator_value"))
    if noise_to_step and m["kind"] == "transformer":
        # the demo Transformer's attention key biases have gradients that are rounding noise (mathematically 0);
        # another summation order draws other noise, which these optimizers turn into steps of full size: no
        # reference to compare with (our zoo's BatchNorm follows a nonlinearity, so no bias feeds it directly)
        ex["optimizer"] = {"name": "Adam", "kwargs": OPTIMIZERS["Adam"][0]}
    if ex["compression"] is not None and ex["state"] != "node_sharded":  # (refused with node_sharded)
        # the documented bound of a codec (composition.md, "Tolerances of 2d") is on SGD's update, which follows the
        # gradient; an optimizer that normalizes the step turns a gradient's compression error into a step of full
        # size. collectives.md: Lightning's clipping does not reach the error-feedback residuals (clip with
        # GradNormBackoff)
        if ex["optimizer"]["name"] != "SGD":
            ex["optimizer"] = {"name": "SGD", "kwargs": OPTIMIZERS["SGD"][1]}
        ex["second"] = "SGD"
        ex["clip"] = None
    if ex["sync_every"] > 1:
        # buffers under local SGD (broadcast from rank 0 of the world or of the node?) are not documented
        m["batchnorm"] = False
    if ex["skip_batch"] is not None and world > 1:
        ex["skip_batch"] = None  # Lightning: "Skipping the training_step ... in distributed training is not supported"
    if ex["steps"] < 2 * EPOCH_STEPS:
        ex["ckpt_during"] = False  # the mid-fit checkpoint is at the end of the first of two epochs
    for use in ("resume", "eval"):
        u = ex[use]
        if u is None:
            continue
        if u["from"] == "during" and not ex["ckpt_during"]:
            if ex["steps"] >= 2 * EPOCH_STEPS:
                ex["ckpt_during"] = True
            else:
                u["from"] = "after"
        if u["from"] == "after" and not ex["save_after"]:
            ex["save_after"] = True
    r = ex["resume"]
    if r is not None:
        if r["layout"] == "world1" and world == 1:
            r["layout"] = "same"
        if r["layout"] == "replicated" and not _sharded(ex):
            r["layout"] = "same"
        if r["layout"] == "ram" and ex["store"] is None:
            r["layout"] = "same"
    # every example is compared with a reference the docs make a promise about: the same fit without a capability
    # documented as bit for bit (twin), or Lightning's "ddp" in float64 (1e-9). Where neither exists, float64.
    if not twin_changes(ex) and ex["precision"] != "64-true":
        ex["precision"] = "64-true"
    if ex["resume"] is not None and ex["resume"]["layout"] in ("world1", "replicated"):
        # one rank against two trains other batches (compared with "ddp" resumed alike); node_sharded against
        # replicated differs by float64 rounding only
        ex["precision"] = "64-true"
    if loses_plateau_step(ex):
        ex["precision"] = "64-true"  # compared with "ddp" resumed alike
    if ex["sync_every"] > 1:
        # the nodes hold different weights and optimizer states (collectives.md): a resume is promised exact in the
        # same layout (reliability.md), evaluated from a checkpoint between two averages nothing is promised for
        # the other nodes, and the reference (Lightning's "ddp" inside each node, tests/differential/plan.py)
        # resumes rank 0's state on every node
        if ex["sync_every"] % 2:
            ex["eval"] = None
        if r is not None:
            r["from"], r["layout"] = "during", ("ram" if r["layout"] == "ram" else "same")
            if ex["steps"] >= 2 * EPOCH_STEPS:
                ex["ckpt_during"] = True
            if not ex["ckpt_during"] or casts_on_load(ex) or loses_plateau_step(ex):
                ex["resume"] = None
    if resumed_against_ddp(ex):
        # "ddp" does not restore the RNG states on resume (strategy.md), HorizonStrategy does: dropout masks differ
        m["dropout"] = False
    if ex["sync_every"] == 1:
        ex["outer"], ex["overlap"] = "average", False  # options of the periodic sync
    if m["kind"] != "zoo":
        m["bag"] = False  # the zoo's tokens are its ids
    if not m["bag"]:
        m["bag_weights"] = m["bag_disk"] = False  # options of the bag
    if m["bag"]:
        # the table steps with SparseSGD at its group's lr: the same as "ddp"'s dense table under plain SGD
        # (embedding.md); it is the module's first parameter, so in the first optimizer
        ex["optimizer"] = {"name": "SGD", "kwargs": OPTIMIZERS["SGD"][0]}
    if m["compile"] and ex["world"] > 1:
        # torch's DDPOptimizer (dynamo under DDP) asserts buckets of at least its 1 MiB first bucket; Lightning's
        # "ddp" raises alike (docs/composition.md)
        ex["bucket_mb"] = 1.0
    if ex["collectives"] != "auto" and not (m["bag"] == "auto" and ex["world"] // ex["rpn"] > 1):
        ex["cost_model"] = None  # the option of collectives="auto" and of a table's span="auto" on several nodes
    elif ex["cost_model"] is None:
        ex["cost_model"] = "slow"  # never the probe: its timings would make the choices
    return _constrain_position(ex)


def _constrain_position(ex: dict) -> dict:
    """Where the mid-fit checkpoint is and where a resume from it runs (data_position.py)."""
    m, r = ex["model"], ex["resume"]
    ex.setdefault("ckpt_at", EPOCH_STEPS)
    if r is not None and r["layout"] == "regrid":
        # a resume into another world size with the same global batch ends where the uninterrupted fit ends, within
        # float64 rounding (reliability.md), where nothing per rank enters the arithmetic: no dropout (per-rank
        # generators), no batch norm (per-rank batch statistics), no codec or local SGD (per-rank residuals, node
        # weights), no sharded table; from the mid-fit checkpoint
        as_regrid = {**ex, "precision": "64-true", "resume": {**r, "from": "during"}}
        if ex["steps"] < 2 * EPOCH_STEPS or casts_on_load(as_regrid) or loses_plateau_step(as_regrid):
            r["layout"] = "same"  # no mid-fit checkpoint, or a resume that is not exact at any world size
            r.pop("world", None), r.pop("rpn", None)
        else:
            r.setdefault("rpn", 1)
            if r["world"] == ex["world"] or r["world"] not in REGRID_WORLDS[ex["world"]] or r["world"] % r["rpn"]:
                r.update(world=REGRID_WORLDS[ex["world"]][0], rpn=1)
            r["from"], ex["ckpt_during"] = "during", True
            ex.update(precision="64-true", compression=None, sync_every=1, outer="average", overlap=False,
                      skip_batch=None)
            m.update(dropout=False, batchnorm=False, bag=False, bag_weights=False, bag_disk=False)
            if ex["collectives"] != "auto":
                ex["cost_model"] = None  # the table's span="auto" needed it, the table is gone
    elif r is not None:
        r.pop("world", None), r.pop("rpn", None)
    if not ex["ckpt_during"] or (r is not None and r["from"] == "during" and (
            r["layout"] == "world1" or resumed_against_ddp(ex))):
        # one rank with the per-rank batch of several is another global batch; Lightning's "ddp" resumed alike
        # restarts the epoch's batches: a resume compared with either is from the epoch's end
        ex["ckpt_at"] = EPOCH_STEPS
    return ex


def ckpt_step(ex: dict) -> int:
    """The optimizer step after which the mid-fit checkpoint is written."""
    return ex.get("ckpt_at", EPOCH_STEPS)


# ------------------------------------------------------------------------------------------------ refusals

#: Combinations refused by design: (name, predicate, phrases the error must contain (both sides), when, the doc
#: that says so). An example matching one runs alone and must raise then; a message missing a phrase, an error at
#: another time, or training on, is a finding.
Refusal = tuple[str, Callable[[dict], bool], Callable[[dict], list[str]], str, str]


def _one_row_compressed(ex: dict) -> bool:
    """torus2d compresses its column stage only: a grid of one row that spans nodes would compress nothing."""
    shape = ex["torus_shape"]
    return (ex["collectives"] == "torus2d" and ex["compression"] is not None and shape is not None and shape[1] == 1
            and shape[0] > ex["rpn"])


def _sharded(ex: dict) -> bool:
    """Whether the state is sharded: node_sharded with several ranks per node or shard groups of several nodes."""
    return ex["state"] == "node_sharded" and (ex["rpn"] > 1 or ex["shard_nodes"] > 1)


def _in_backward_conflicts(ex: dict) -> list[str]:
    """What keeps a store's step out of backward (store/step.py's backward_step_conflicts, from the example)."""
    out = []
    if ex["optimization"] == "manual":
        out += ["2 optimizers", "manual optimization"]
    if ex["world"] > 1:
        out.append(f"{ex['world']} ranks")
    clip = ex["clip"]
    if clip and clip["where"] == "trainer":
        out.append(f"gradient_clip_val={clip['value']}")
    if clip and clip["where"] == "hook":
        out.append("configure_gradient_clipping")
    if ex["precision"].startswith("bf16-true"):
        out.append("mode='bf16-true'")
    if ex["backoff"] is not None:
        out.append("GradNormBackoff.on_before_optimizer_step")
    return out


#: in the order HorizonStrategy checks them (the first that matches is the one raised)
REFUSED: list[Refusal] = [
    ("compression with local SGD", lambda ex: ex["compression"] is not None and ex["sync_every"] > 1,
     lambda ex: [f"compression={ex['compression']!r}", f"sync_every={ex['sync_every']}"], "construction",
     "composition.md"),
    ("node_sharded with torus2d", lambda ex: ex["state"] == "node_sharded" and ex["collectives"] == "torus2d",
     lambda ex: ["collectives='torus2d'", "state='node_sharded'"], "construction", "node_state.md"),
    ("node_sharded with compression", lambda ex: ex["state"] == "node_sharded" and ex["compression"] is not None,
     lambda ex: [f"compression={ex['compression']!r}", "state='node_sharded'"], "construction", "node_state.md"),
    ("node_sharded with local SGD", lambda ex: ex["state"] == "node_sharded" and ex["sync_every"] > 1,
     lambda ex: [f"sync_every={ex['sync_every']}", "state='node_sharded'"], "construction", "node_state.md"),
    ("store with node_sharded", lambda ex: ex["store"] is not None and ex["state"] == "node_sharded",
     lambda ex: ["state_store=", "state='node_sharded'"], "construction", "out_of_core.md"),
    ("compression with a one-row torus across nodes", _one_row_compressed,
     lambda ex: ["collectives='torus2d'", f"compression={ex['compression']!r}", "no column stage"], "construction",
     "collectives.md"),
    ("ShardedEmbeddingBag with local SGD", lambda ex: ex["model"]["bag"] and ex["sync_every"] > 1,
     lambda ex: ["ShardedEmbeddingBag", f"sync_every={ex['sync_every']}"], "setup", "embedding.md"),
    ("ShardedEmbeddingBag with the store", lambda ex: ex["model"]["bag"] and ex["store"] is not None,
     lambda ex: ["ShardedEmbeddingBag", "state_store=", "both take the parameters' storage"], "setup",
     "embedding.md"),
    ("ShardedEmbeddingBag with node_sharded", lambda ex: ex["model"]["bag"] and _sharded(ex),
     lambda ex: ["ShardedEmbeddingBag", "state='node_sharded'", "both take the parameters' storage"], "setup",
     "embedding.md"),
    ("ShardedEmbeddingBag with bf16-true", lambda ex: ex["model"]["bag"] and ex["precision"].startswith("bf16-true"),
     lambda ex: ["ShardedEmbeddingBag", "float32 or float64", "bfloat16"], "setup", "embedding.md"),
    ("node_sharded with LBFGS", lambda ex: _sharded(ex) and ex["optimizer"]["name"] == "LBFGS",
     lambda ex: ["state='node_sharded'", "LBFGS"], "setup", "node_state.md"),
    ("bf16-true with LBFGS", lambda ex: ex["precision"].startswith("bf16-true") and ex["optimizer"]["name"] == "LBFGS",
     lambda ex: ["mode='bf16-true'", "LBFGS"], "setup", "precision.md"),
    ("store with LBFGS", lambda ex: ex["store"] is not None and ex["optimizer"]["name"] == "LBFGS",
     lambda ex: ["state_store=", "LBFGS"], "setup", "out_of_core.md"),
    ("store step in backward with what needs the whole gradient",
     lambda ex: ex["store"] is not None and ex["store"]["step"] == "in_backward" and bool(_in_backward_conflicts(ex)),
     lambda ex: ["step='in_backward'", *_in_backward_conflicts(ex)], "setup", "out_of_core.md"),
]


def refusal(ex: dict) -> Optional[tuple[str, list[str], str]]:
    """(name, phrases, when) of the first refusal ``ex`` matches, or None."""
    for name, when, phrases, at, _doc in REFUSED:
        if when(ex):
            return name, phrases(ex), at
    return None


def unrefuse(ex: dict) -> dict:
    """The example with the refused combination resolved towards what trains (one side of the pair dropped)."""
    ex = copy.deepcopy(ex)
    for _ in range(len(REFUSED)):
        hit = refusal(ex)
        if hit is None:
            break
        name = hit[0]
        keep_sharded = ex["seed"] % 2 == 0  # either side of the pair, by seed: both go on being drawn
        if name == "compression with local SGD":
            ex["sync_every" if keep_sharded else "compression"] = 1 if keep_sharded else None
        elif name in ("node_sharded with torus2d", "node_sharded with compression", "node_sharded with local SGD") \
                and not keep_sharded:
            ex["state"] = "replicated"
        elif name == "node_sharded with torus2d":
            ex["collectives"] = "hierarchical"
        elif name == "node_sharded with compression":
            ex["compression"] = None
        elif name == "node_sharded with local SGD":
            ex["sync_every"] = 1
        elif name == "store with node_sharded":
            ex["state"] = "replicated"
        elif name == "compression with a one-row torus across nodes":
            ex["torus_shape" if keep_sharded else "compression"] = [1, 4] if keep_sharded else None
        elif name.startswith("ShardedEmbeddingBag") and keep_sharded:
            ex["model"]["bag"] = False
        elif name == "ShardedEmbeddingBag with local SGD":
            ex["sync_every"] = 1
        elif name == "ShardedEmbeddingBag with the store":
            ex["store"] = None
        elif name == "ShardedEmbeddingBag with node_sharded":
            ex["state"] = "replicated"
        elif name == "ShardedEmbeddingBag with bf16-true":
            ex["precision"] = "64-true"
        elif "LBFGS" in name:
            ex["optimizer"] = {"name": "SGD", "kwargs": OPTIMIZERS["SGD"][1]}
        else:
            ex["store"]["step"] = "auto"
        ex = constrain(ex)
    return ex


# ------------------------------------------------------------------------------------------------ references


def twin_changes(ex: dict) -> dict:
    """What the bit-for-bit twin changes: the capabilities the docs promise are the same bits as without them
    (out_of_core.md: a store = RAM; sharding.md / composition.md 2a: recompute = none; composition.md 2b:
    bf16-mixed with fp32 compute = 32-true; node_state.md: one rank per node is replicated)."""
    out: dict = {}
    if ex["store"] is not None:
        out["store"] = None
    if ex["sharding"] is not None:
        out["sharding"] = None
    if ex["state"] == "node_sharded" and not _sharded(ex):
        out["state"] = "replicated"
    if ex["precision"] == "bf16-mixed":
        twin = {**ex, **out, "precision": "32-true"}
        if refusal(twin) is None:
            out["precision"] = "32-true"
    return out


#: optimizers with floating-point scalar state besides "step" (NAdam's mu_product, ASGD's eta and mu), created in
#: the default dtype: torch's Optimizer.load_state_dict casts it to the parameter's dtype, so under float64 a
#: resumed fit computes with it in float64 where the uninterrupted one used float32 (Lightning's "ddp" alike)
SCALAR_STATE = ("NAdam", "ASGD")


def casts_on_load(ex: dict) -> bool:
    names = [ex["optimizer"]["name"]] + ([ex["second"]] if ex["optimization"] == "manual" else [])
    return ex["precision"] == "64-true" and any(n in SCALAR_STATE for n in names)


def loses_plateau_step(ex: dict) -> bool:
    """A resume from the mid-fit checkpoint misses that epoch's ReduceLROnPlateau step: Lightning's fit loop steps
    a plateau scheduler after ``on_train_epoch_end``, where ModelCheckpoint saves (reliability.md; "ddp" alike)."""
    r, s = ex["resume"], ex["scheduler"]
    return r is not None and r["from"] == "during" and s is not None and s["name"] == "ReduceLROnPlateau"


def resumes_exactly(ex: dict) -> bool:
    """The resumed fit continues the uninterrupted one (compared with it, tests/differential/plan.py): from the
    mid-fit checkpoint, in the layout that wrote it (or replicated, or in RAM), with nothing cast or lost on load."""
    r = ex["resume"]
    return (r is not None and r["from"] == "during" and r["layout"] != "world1" and not casts_on_load(ex)
            and not loses_plateau_step(ex))


def resumed_against_ddp(ex: dict) -> bool:
    """The resumed fit is compared with "ddp" resumed alike (tests/differential/plan.py)."""
    return ex["resume"] is not None and ex["precision"] == "64-true" and not resumes_exactly(ex)


def needs_unused(ex: dict) -> bool:
    """A parameter without a gradient in some step: DDP needs ``find_unused_parameters=True``."""
    return ex["model"]["never"] or ex["model"]["sometimes"]


def n_optimizers(ex: dict) -> int:
    return 2 if ex["optimization"] == "manual" else 1


def key(ex: dict) -> str:
    return json.dumps(ex, sort_keys=True, separators=(",", ":"))


def summary(ex: dict) -> str:
    """One line naming the example's non-default choices."""
    m = ex["model"]
    parts = [f"w{ex['world']}" + (f"x{ex['rpn']}" if ex["rpn"] > 1 else ""), m["kind"]]
    parts += [f + (f"-{m[f]}" if isinstance(m[f], str) else "") for f in MODEL_FLAGS if m[f]]
    parts.append(ex["optimizer"]["name"] + ("" if not ex["optimizer"]["kwargs"] else
                                            "(" + ",".join(f"{k}={v}" for k, v in ex["optimizer"]["kwargs"].items()
                                                           if k != "lr") + ")").replace("()", ""))
    if ex["optimization"] == "manual":
        parts.append(f"manual+{ex['second']}")
    if ex["scheduler"]:
        parts.append(f"{ex['scheduler']['name']}/{ex['scheduler']['interval']}")
    if ex["accumulate"] > 1:
        parts.append(f"accumulate{ex['accumulate']}")
    if ex["clip"]:
        parts.append(f"clip-{ex['clip']['where']}-{ex['clip']['algorithm']}={ex['clip']['value']}")
    if ex["skip_batch"] is not None:
        parts.append(f"skip{ex['skip_batch']}")
    for flag in ("validate", "ckpt_during", "save_after"):
        if ex[flag]:
            parts.append(flag)
    if ex["ckpt_during"] and ckpt_step(ex) != EPOCH_STEPS:
        parts.append(f"ckpt-at-{ckpt_step(ex)}")
    if ex["resume"]:
        parts.append(f"resume-{ex['resume']['from']}-{ex['resume']['layout']}"
                     + (f"-w{ex['resume']['world']}x{ex['resume']['rpn']}" if "world" in ex["resume"] else ""))
    if ex["eval"]:
        parts.append(f"{ex['eval']['kind']}-from-{ex['eval']['from']}")
    if ex["state"] != "replicated":
        parts.append(ex["state"] + (f"-groups{ex['shard_nodes']}" if ex["shard_nodes"] > 1 else ""))
    if ex["store"]:
        parts.append(f"store-{ex['store']['step']}-{ex['store']['prefetch']}")
    if ex["sharding"]:
        parts.append(f"sharding-{ex['sharding']}")
    if ex["collectives"] != "flat":
        parts.append(ex["collectives"] + (f"{ex['torus_shape'][0]}x{ex['torus_shape'][1]}" if ex["torus_shape"]
                                          else "") + (f"-{ex['cost_model']}" if ex["cost_model"] else ""))
    if ex["compression"]:
        parts.append(f"compress-{ex['compression']}")
    if ex["sync_every"] > 1:
        parts.append(f"sync_every={ex['sync_every']}" + ("-nesterov" if ex["outer"] == "nesterov" else "")
                     + ("-overlap" if ex["overlap"] else ""))
    if ex["backoff"]:
        parts.append(f"backoff={ex['backoff']['max_norm']}")
    parts += [ex["precision"], f"{ex['steps']}steps"]
    return " ".join(parts)


__all__ = ["CKPT_STEPS", "COMPRESSIONS", "COST_MODELS", "EPOCH_STEPS", "OPTIMIZERS", "REFUSED", "REGRID_WORLDS",
           "ckpt_step", "constrain", "draw", "key",
           "loses_plateau_step", "n_optimizers", "needs_unused", "resumes_exactly",
           "refused_examples", "refusal", "simplest", "summary", "twin_changes", "unrefuse"]
