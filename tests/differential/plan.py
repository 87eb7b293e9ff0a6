"""The fits an example needs and what each is compared with: the example itself ("main"), its references (the
bit-for-bit "twin" without the capabilities whose docs promise the same bits; Lightning's "ddp" in float64), and
the resumed fits of its lifecycle. A fit is a spec for tests/scripts/differential_fit.py."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from typing import Optional

from tests.differential.space import (EPOCH_STEPS, ckpt_step, key, n_optimizers, refusal, resumes_exactly,
                                      twin_changes)

#: what a comparison may differ by, per reference (docs/composition.md, "The differential tester", has the why)
BITWISE, FLOAT64 = 0.0, 1e-9
#: a compressed fit against Lightning's uncompressed "ddp": the codec's documented bound on the relative deviation
#: of the training update (docs/composition.md, "Tolerances of 2d")
CODEC_BOUND = {"bf16": 0.015, "int8": 0.1}


def spec(engine: str, ex: dict, *, steps: Optional[int] = None, resume_from: Optional[str] = None,
         lifecycle: bool = True, expect_error: Optional[list[str]] = None, perturb: bool = False) -> dict:
    body = {"engine": engine, "ex": ex, "steps": steps or ex["steps"], "resume_from": resume_from,
            "lifecycle": lifecycle, "expect_error": expect_error, "perturb": perturb}
    name = f"{engine}-w{ex['world']}-" + hashlib.sha1(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]
    return {"name": name, "world": ex["world"], **body}


def ckpt_path(run: dict, which: str) -> str:
    """A checkpoint of ``run`` by its place in the lifecycle, relative to the work folder."""
    if which == "during":
        return f"{run['name']}/ckpt/step={ckpt_step(run['ex']) * n_optimizers(run['ex'])}.ckpt"
    return f"{run['name']}/after.ckpt"


def relayout(ex: dict, layout: str) -> dict:
    """The example as the fit that resumes it runs: in another layout, with no lifecycle of its own."""
    ex = copy.deepcopy(ex)
    if layout == "world1":
        ex.update(world=1, rpn=1, state="replicated", collectives="flat", torus_shape=None, cost_model=None,
                  compression=None, sync_every=1, shard_nodes=1, outer="average", overlap=False)
    elif layout == "replicated":
        ex.update(state="replicated", shard_nodes=1)
    elif layout == "ram":
        ex["store"] = None
    elif layout == "regrid":  # another world size, the same global batch and data (data_position.py)
        world = ex["resume"]["world"]
        ex.update(world=world, rpn=ex["resume"]["rpn"], data_world=ex.get("data_world", ex["world"]),
                  state="replicated", store=None, collectives="flat", torus_shape=None, cost_model=None,
                  shard_nodes=1, skip_batch=None)
    ex.update(ckpt_during=False, save_after=False, resume=None, eval=None)
    return ex


def for_ddp(ex: dict) -> dict:
    """The example as Lightning's "ddp" trains it: HorizonStrategy's options at their defaults (so that examples
    that differ in those only share their reference fit), a sharded table as a dense one. Local SGD keeps its nodes
    and period: the reference is "ddp" inside each node with the parameters averaged across nodes
    (tests/scripts/differential_fit.py)."""
    local_sgd = ex["sync_every"] > 1
    out = {**copy.deepcopy(ex), "rpn": ex["rpn"] if local_sgd else 1, "state": "replicated", "store": None,
           "sharding": None, "collectives": "flat", "torus_shape": None, "cost_model": None, "compression": None,
           "bucket_mb": 1.0, "shard_nodes": 1}
    if out["model"]["bag"]:
        out["model"]["bag"] = "dense"  # a plain nn.EmbeddingBag the optimizer steps (tests/differential/models.py)
    return out


@dataclass
class Plan:
    ex: dict
    main: dict
    refs: dict[str, dict] = field(default_factory=dict)  # "twin" / "ddp" -> spec
    resumed: Optional[dict] = None
    #: what the resumed fit ends like: ("main", tol) the uninterrupted fit, or ("resumed_ref", tol)
    resumed_against: Optional[tuple[str, float]] = None
    resumed_ref: Optional[dict] = None
    refused: Optional[tuple[str, list[str], str]] = None
    #: Lightning's "ddp" on the example where no "ddp" reference runs: run only when the example raises, to tell
    #: an error of its own from one Lightning raises alike
    arbiter: Optional[dict] = None

    def specs(self) -> list[dict]:
        return [self.main, *self.refs.values(), *(s for s in (self.resumed, self.resumed_ref) if s is not None)]


def tolerance(role: str, ex: dict) -> float:
    """The twin: bitwise; "ddp": float64 rounding, or the codec's bound where ``ex`` compresses (then on the
    training update: tests/differential/compare.py)."""
    if role == "twin":
        return BITWISE
    return CODEC_BOUND[ex["compression"]] if ex["compression"] else FLOAT64


def plan(ex: dict) -> Plan:
    refused = refusal(ex)
    if refused is not None:
        return Plan(ex, spec("horizon", ex, expect_error=refused[1]), refused=refused)
    plant = bool(ex.get("plant"))  # the planted defect: every reference's learning rate x (1 + 1e-6)
    p = Plan(ex, spec("horizon", ex))
    changes = twin_changes(ex)
    if changes:
        p.refs["twin"] = spec("horizon", {**ex, **changes}, perturb=plant)
    if ex["precision"] == "64-true":
        p.refs["ddp"] = spec("ddp", for_ddp(ex), perturb=plant)
    else:
        lightning = ex["precision"] if ex["precision"] in ("64-true", "32-true") else "32-true"
        p.arbiter = spec("ddp", for_ddp({**ex, "precision": lightning}))
    r = ex["resume"]
    if r is None:
        return p
    steps = ex["steps"] if r["from"] == "during" else ex["steps"] + EPOCH_STEPS
    p.resumed = spec("horizon", relayout(ex, r["layout"]), steps=steps, resume_from=ckpt_path(p.main, r["from"]),
                     lifecycle=False)
    if resumes_exactly(ex):
        # node_state.md, reliability.md: a resume in the same layout continues bit for bit; a store is RAM's bits;
        # node_sharded -> replicated differs by float64 rounding (the example is float64 then)
        p.resumed_against = ("main", FLOAT64 if r["layout"] in ("replicated", "regrid") else BITWISE)
        return p
    role = "ddp" if "ddp" in p.refs else "twin"
    ref = p.refs[role]
    # "ddp" resumes from this fit's own checkpoint: the resume itself is compared, from the same state. The
    # checkpoints are compared on their own (compare.py, "ddp:ckpt_*"); resuming each from its own would compound
    # their float64 rounding (within 1e-9) through the resumed steps (LBFGS with a strong clip: 1e-10 -> 1e-5)
    source = p.main if role == "ddp" else ref
    p.resumed_ref = spec(ref["engine"], relayout(ref["ex"], r["layout"]), steps=steps,
                         resume_from=ckpt_path(source, r["from"]), lifecycle=False, perturb=plant)
    p.resumed_against = ("resumed_ref", tolerance(role, ex))
    return p


__all__ = ["BITWISE", "CODEC_BOUND", "FLOAT64", "Plan", "ckpt_path", "key", "plan", "relayout", "spec", "tolerance"]
