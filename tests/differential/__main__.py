"""python -m tests.differential [--examples N] [--world 1,2,4] [--seed S] [--example JSON] [--no-shrink] [--keep DIR]

Draws examples ``S .. S+N-1`` at each world size (or runs the one ``--example``), runs them with their references,
prints what was drawn, every failure and, for each, the smallest configuration that still fails with a one-line
reproduction. Exit status 1 when an example failed."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from tests.differential.session import coverage, format_coverage, run_session
from tests.differential.space import draw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.differential", description=__doc__.split("\n\n")[1])
    ap.add_argument("--examples", type=int, default=20, help="examples per world size")
    ap.add_argument("--world", default="1,2", help="world sizes, comma-separated (1, 2, 4)")
    ap.add_argument("--seed", type=int, default=0, help="the first seed")
    ap.add_argument("--example", help="one example as JSON (a reproduction line prints it)")
    ap.add_argument("--no-shrink", action="store_true", help="report failures as drawn")
    ap.add_argument("--keep", help="keep the fits' results and checkpoints in this folder")
    args = ap.parse_args(argv)
    if args.example:
        examples = [json.loads(args.example)]
    else:
        worlds = [int(w) for w in args.world.split(",")]
        examples = [draw(s, w) for w in worlds for s in range(args.seed, args.seed + args.examples)]
    print("drawn:\n" + format_coverage(coverage(examples)), flush=True)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="differential-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        outcomes, reports = run_session(examples, work, shrink_failures=not args.no_shrink,
                                        log=lambda s: print(s, flush=True))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    worst: dict[str, float] = {}
    for o in outcomes:
        for role, v in o.measured.items():
            worst[role] = max(worst.get(role, 0.0), v)
    unjudged = sum(1 for o in outcomes if not o.failed and o.problems)
    print(f"\n{len(outcomes)} examples, {len(reports)} failed, {unjudged} unjudged (Lightning's \"ddp\" raised);"
          " largest relative deviation per reference: "
          + ", ".join(f"{k} {v:.3g}" for k, v in sorted(worst.items())))
    return 1 if reports else 0


if __name__ == "__main__":
    sys.exit(main())
