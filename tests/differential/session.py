"""A session of the differential tester: run examples (all their fits in few launches), check each, shrink a
failure, print what was drawn and the reproduction of what failed. Used by ``python -m tests.differential`` and by
tests/test_differential.py."""

from __future__ import annotations

import collections
import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from tests.differential.compare import Problem, check, first_error, signature
from tests.differential.plan import Plan, plan
from tests.differential.runner import Runner
from tests.differential.shrink import shrink
from tests.differential.space import EPOCH_STEPS, MODEL_FLAGS, ckpt_step, refusal, summary


@dataclass
class Outcome:
    ex: dict
    plan: Plan
    problems: list[Problem]
    measured: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return bool(signature(self.problems))


def evaluate(examples: list[dict], runner: Runner, mains_only: bool = False) -> list[Outcome]:
    """Run and check ``examples``. ``mains_only``: the examples' own fits, not their references (shrinking a
    failure that raises: what fails is the fit itself, and a raising fit of several ranks ends its launch, so each
    fit not run saves a launch)."""
    plans = [plan(ex) for ex in examples]
    runner.run(s for p in plans for s in ([p.main] if mains_only else p.specs()))
    # where the example raised: does Lightning's "ddp" raise alike?
    runner.run(a for p in plans if (a := p.refs.get("ddp") or p.arbiter) is not None
               and first_error(p.main, runner) is not None)
    return [Outcome(p.ex, p, *check(p, runner)) for p in plans]


def reproduction(ex: dict) -> str:
    return "python -m tests.differential --example " + shlex.quote(json.dumps(ex, separators=(",", ":")))


def minimize(outcome: Outcome, runner: Runner, log: Callable[[str], None] = print) -> tuple[Outcome, list[str]]:
    """The smallest example that still fails with one of ``outcome``'s problem categories, and how it got there."""
    wanted = signature(outcome.problems)
    last: dict[str, Outcome] = {}

    raises = any(c.startswith("error:main") for c in wanted)

    def fails(batch: list[dict]) -> list[bool]:
        results = evaluate(batch, runner, mains_only=raises)
        for r in results:
            last[json.dumps(r.ex, sort_keys=True)] = r
        return [bool(signature(r.problems) & wanted) for r in results]

    ex, kept = shrink(outcome.ex, fails, log=log)
    smallest = last.get(json.dumps(ex, sort_keys=True), outcome)
    return smallest, kept


def report(outcome: Outcome, shrunk: Optional[tuple[Outcome, list[str]]] = None, limit: int = 8) -> str:
    ex = outcome.ex
    lines = [f"FAILED seed {ex['seed']} world {ex['world']}: {summary(ex)}"]
    lines += [f"    [{c}] {m}" for c, m in outcome.problems[:limit]]
    if len(outcome.problems) > limit:
        lines.append(f"    ... {len(outcome.problems) - limit} more")
    if shrunk is not None:
        small, kept = shrunk
        lines.append(f"  smallest that still fails ({len(kept)} simplifications: {', '.join(kept) or 'none'}):")
        lines.append(f"    {summary(small.ex)}")
        lines += [f"    [{c}] {m}" for c, m in small.problems[:limit]]
        lines.append(f"  reproduce: {reproduction(small.ex)}")
    lines.append(f"  drawn as: python -m tests.differential --seed {ex['seed']} --world {ex['world']} --examples 1")
    return "\n".join(lines)


def coverage(examples: list[dict]) -> dict[str, collections.Counter]:
    """What the examples drew, by dimension."""
    c: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for ex in examples:
        hit = refusal(ex)
        c["refused"][hit[0] if hit else "-"] += 1
        c["world"][f"{ex['world']}x{ex['rpn']}" if ex["rpn"] > 1 else str(ex["world"])] += 1
        c["model"][ex["model"]["kind"]] += 1
        for f in MODEL_FLAGS:
            c["model flags"][f] += bool(ex["model"][f])
        c["optimizer"][ex["optimizer"]["name"]] += 1
        c["scheduler"][ex["scheduler"]["name"] if ex["scheduler"] else "-"] += 1
        c["optimization"][ex["optimization"]] += 1
        c["accumulate"][ex["accumulate"]] += 1
        c["clip"][f"{ex['clip']['where']}-{ex['clip']['algorithm']}" if ex["clip"] else "-"] += 1
        c["habits"]["skip a batch"] += ex["skip_batch"] is not None
        c["habits"]["validation"] += ex["validate"]
        c["lifecycle"]["checkpoint during fit"] += ex["ckpt_during"]
        c["lifecycle"]["checkpoint mid-epoch"] += ex["ckpt_during"] and ckpt_step(ex) % EPOCH_STEPS != 0
        c["lifecycle"]["save after fit"] += ex["save_after"]
        if ex["resume"]:
            c["lifecycle"][f"resume from {ex['resume']['from']} ({ex['resume']['layout']})"] += 1
        if ex["eval"]:
            c["lifecycle"][f"{ex['eval']['kind']} from {ex['eval']['from']}"] += 1
        groups = f", shard groups of {ex['shard_nodes']} nodes" if ex["shard_nodes"] > 1 else ""
        c["state"][ex["state"] if ex["state"] == "replicated" else f"node_sharded ({ex['rpn']} per node{groups})"] += 1
        c["store"][ex["store"]["step"] if ex["store"] else "-"] += 1
        c["sharding"][ex["sharding"] or "-"] += 1
        c["collectives"][ex["collectives"] + (f" {ex['torus_shape'][0]}x{ex['torus_shape'][1]}" if ex["torus_shape"]
                                              else "") + (f" ({ex['cost_model']})" if ex["cost_model"] else "")] += 1
        c["compression"][str(ex["compression"])] += 1
        c["sync_every"][ex["sync_every"]] += 1
        if ex["sync_every"] > 1:
            c["outer"][f"{ex['outer']}{' overlapped' if ex['overlap'] else ''}"] += 1
        c["backoff"][str(ex["backoff"]["max_norm"]) if ex["backoff"] else "-"] += 1
        c["precision"][ex["precision"]] += 1
    return c


def format_coverage(c: dict[str, collections.Counter]) -> str:
    return "\n".join(f"  {dim}: " + ", ".join(f"{k} {v}" for k, v in sorted(cnt.items(), key=lambda kv: -kv[1]) if v)
                     for dim, cnt in c.items())


def run_session(examples: list[dict], work: Path, shrink_failures: bool = True,
                log: Callable[[str], None] = print) -> tuple[list[Outcome], list[str]]:
    """Run, check, shrink each failure; returns the outcomes and one report per failure."""
    runner = Runner(work)
    t0 = time.monotonic()
    outcomes = evaluate(examples, runner)
    fits = sum(len(o.plan.specs()) for o in outcomes)
    launches = ", ".join(f"{w} rank(s) x {n} fits {s:.0f}s" for w, n, s in runner.timings)
    log(f"differential: {len(examples)} examples, {fits} fits, {time.monotonic() - t0:.0f}s ({launches})")
    reports = []
    for o in outcomes:
        if o.failed:
            reports.append(report(o, minimize(o, runner, log) if shrink_failures else None))
            log(reports[-1])
    return outcomes, reports


__all__ = ["Outcome", "coverage", "evaluate", "format_coverage", "minimize", "report", "reproduction",
           "run_session"]
