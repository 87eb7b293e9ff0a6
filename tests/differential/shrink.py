"""Shrink a failing example: reset its dimensions to their simplest value one at a time (and fewer steps, fewer
ranks), keep each simplification under which it still fails, until none is left. The candidates of one round are
judged together (``fails`` gets a list: one batch of launches), then the ones that kept failing are tried all at
once; a round costs one or two batches."""

from __future__ import annotations

import copy
from typing import Callable, Optional

from tests.differential.space import MODEL_FLAGS, OPTIMIZERS, constrain, key, refusal


def _set(path: str, value) -> Callable[[dict], dict]:
    def apply(ex: dict) -> dict:
        ex = copy.deepcopy(ex)
        node = ex
        *parents, last = path.split(".")
        for p in parents:
            if node.get(p) is None:
                return ex
            node = node[p]
        node[last] = value
        return ex
    return apply


def _fewer_ranks(ex: dict) -> dict:
    return {**copy.deepcopy(ex), "world": {4: 2, 2: 1}.get(ex["world"], ex["world"])}


def _first_variant(ex: dict) -> dict:
    ex = copy.deepcopy(ex)
    ex["optimizer"]["kwargs"] = OPTIMIZERS[ex["optimizer"]["name"]][0]
    return ex


#: (label, simplification) in the order they are tried: what the lifecycle needs goes before what it needs it for
SIMPLIFICATIONS: list[tuple[str, Callable[[dict], dict]]] = [
    ("fewer ranks", _fewer_ranks),
    ("one rank per node", _set("rpn", 1)),
    ("no resume", _set("resume", None)),
    ("resume in the same layout", _set("resume.layout", "same")),
    ("no evaluation", _set("eval", None)),
    ("no checkpoint during fit", _set("ckpt_during", False)),
    ("no checkpoint after fit", _set("save_after", False)),
    ("no validation", _set("validate", False)),
    ("automatic optimization", _set("optimization", "automatic")),
    ("no accumulation", _set("accumulate", 1)),
    ("no clipping", _set("clip", None)),
    ("no skipped batch", _set("skip_batch", None)),
    ("no schedule", _set("scheduler", None)),
    ("SGD", _set("optimizer", {"name": "SGD", "kwargs": OPTIMIZERS["SGD"][0]})),
    ("the optimizer's first variant", _first_variant),
    ("second optimizer SGD", _set("second", "SGD")),
    ("our model", _set("model.kind", "zoo")),
    *[(f"no {flag}", _set(f"model.{flag}", False)) for flag in MODEL_FLAGS],
    ("replicated state", _set("state", "replicated")),
    ("no store", _set("store", None)),
    ("store step auto", _set("store.step", "auto")),
    ("store prefetch read", _set("store.prefetch", "read")),
    ("no sharding", _set("sharding", None)),
    ("no compression", _set("compression", None)),
    ("sync_every 1", _set("sync_every", 1)),
    ("sync_every 2", lambda ex: _set("sync_every", 2)(ex) if ex["sync_every"] > 2 else ex),
    ("flat collectives", _set("collectives", "flat")),
    ("torus2d's default shape", _set("torus_shape", None)),
    ("1 MiB buckets", _set("bucket_mb", 1.0)),
    ("no GradNormBackoff", _set("backoff", None)),
    ("float64", _set("precision", "64-true")),
    ("2 steps", _set("steps", 2)),
]


def candidates(ex: dict) -> list[tuple[str, dict]]:
    """Each simplification that changes ``ex`` (after the generator's constraints) and keeps it as refused or not
    refused as it was."""
    refused = refusal(ex) is not None
    out, seen = [], {key(ex)}
    for label, simplify in SIMPLIFICATIONS:
        c = constrain(simplify(ex))
        if key(c) in seen or (refusal(c) is not None) != refused:
            continue
        seen.add(key(c))
        out.append((label, c))
    return out


def shrink(ex: dict, fails: Callable[[list[dict]], list[bool]], max_rounds: int = 12,
           log: Optional[Callable[[str], None]] = None) -> tuple[dict, list[str]]:
    """The smallest example reachable from ``ex`` that still fails, and the simplifications kept, in order."""
    kept: list[str] = []
    say = log or (lambda s: None)
    for _ in range(max_rounds):
        cands = candidates(ex)
        if not cands:
            break
        verdicts = fails([c for _, c in cands])
        failing = [(label, c) for (label, c), v in zip(cands, verdicts) if v]
        say(f"shrink: {len(failing)} of {len(cands)} simplifications still fail: {[lbl for lbl, _ in failing]}")
        if not failing:
            break
        if len(failing) > 1:
            combined = ex
            for label, _ in failing:
                combined = constrain(dict(SIMPLIFICATIONS)[label](combined))
            if key(combined) != key(ex) and (refusal(combined) is None) == (refusal(ex) is None) \
                    and fails([combined])[0]:
                ex = combined
                kept += [label for label, _ in failing]
                continue
        label, ex = failing[0]
        kept.append(label)
    return ex, kept


__all__ = ["SIMPLIFICATIONS", "candidates", "shrink"]
