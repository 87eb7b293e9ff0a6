"""The layout tuner's command line: time a few optimizer steps of the real training under each candidate layout,
keep the fastest and cache it (lightning_horizon/layout/tuner.py has how).

    python -m lightning_horizon.tune recipes/pretrain_gpt.py --config recipes/configs/small.yaml
    python -m lightning_horizon.tune --layouts 1x2,2x1 recipes/pretrain_gpt.py --config recipes/configs/tiny.yaml

Every flag is checked before any layout runs: a bad flag, a missing script or a script of another shape exits 2;
when no layout ran, the command exits 1 with each one's failure.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Optional

from lightning_horizon.layout import cache as layout_cache
from lightning_horizon.layout.rule import Layout, Machine, candidates, rule_layout
from lightning_horizon.layout.script import ScriptShape, ScriptShapeError, inspect_script
from lightning_horizon.layout.tuner import (ALLOWED, Result, check_same_workload, clean_env, script_command, select,
                                            table, tune)
from lightning_horizon.memory.probe import node_free_memory

LAYOUTS_ALLOWED = "'all' or comma-separated RANKSxTHREADS, e.g. '1x2,2x1'"


def _flag(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` for the flag of tune()'s ``name``: parsed and checked as tune() checks it, so that a bad
    value is argparse's usage error (``argument --flag: invalid value ...: allowed is ...``, exit 2) before
    anything runs."""
    ok, allowed = ALLOWED[name]

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: allowed is {allowed}")
        return value

    return convert


def _layouts(text: str) -> Any:
    """``--layouts``: ``"all"``, or the layouts it lists."""
    if text.strip() == "all":
        return "all"
    try:
        layouts = [Layout.parse(s) for s in text.split(",") if s.strip()]
    except ValueError:
        layouts = []
    if not layouts:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: allowed is {LAYOUTS_ALLOWED}")
    return layouts


def _script(text: str) -> str:
    if not os.path.exists(text):  # else every layout would fail alike, after the machine was probed
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    return text


def main(argv: Optional[list[str]] = None) -> Result:
    """The command line (see the module's docstring): a bad flag, a missing script or one the tuner cannot run exits
    2 before any layout runs; when no layout ran, it exits 1 with each one's failure."""
    a = _parser().parse_args(argv)
    machine = Machine.here()
    layouts = candidates(machine.cores, machine.domains) if a.layouts == "all" else a.layouts
    shape = _inspect(a, layouts)
    print(f"tune: {a.script} {' '.join(a.script_args)} | {machine.describe()} | layouts"
          f" {', '.join(map(str, sorted(layouts)))} | {a.warmup} warm-up + {a.steps} measured steps each", flush=True)
    command = script_command(a.script, a.script_args, a.warmup + a.steps, a.batch_arg, shape.subcommand,
                             shape.strategy_args)
    results = tune(command, layouts,
                   warmup=a.warmup, steps=a.steps, timeout=a.timeout, retries=a.retries,
                   max_foreign=a.max_foreign, global_batch=a.batch,
                   progress=lambda s: print(s, flush=True))
    check_same_workload(results)
    winner = select(results, a.tolerance)
    print(table(results, winner))
    if winner is None:
        why = "".join(f"\n  {r.layout} {r.status}: {r.note}" for r in results)
        print(f"tune: no layout ran; nothing cached:{why}", file=sys.stderr)
        raise SystemExit(1)
    rule = _report(winner, results, machine, a.max_foreign)
    if not a.no_cache:
        _cache(winner, results, rule, machine, a.cache)
    return winner


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lightning_horizon.tune", description=__doc__.split("\n\n")[0],
                                epilog="everything after SCRIPT goes to the script (LightningCLI arguments)")
    p.add_argument("--layouts", type=_layouts, default="all",
                   help="'all' (this machine's candidates) or e.g. '1x2,2x1'")
    p.add_argument("--warmup", type=_flag("warmup", int), default=2, help="steps before measuring (>= 1)")
    p.add_argument("--steps", type=_flag("steps", int), default=5, help="measured steps per layout (>= 2)")
    p.add_argument("--tolerance", type=_flag("tolerance", float), default=0.03,
                   help="a layout this close to the fastest wins when it has fewer ranks (in [0, 1))")
    p.add_argument("--timeout", type=_flag("timeout", float), default=600, help="seconds per layout (> 0)")
    p.add_argument("--max-foreign", type=_flag("max_foreign", float), default=0.10,
                   help="run a layout again when other processes took more than this share of the machine")
    p.add_argument("--retries", type=_flag("retries", int), default=1,
                   help="reruns per layout when the machine was busy (>= 0)")
    p.add_argument("--batch", type=_flag("global_batch", int), default=None,
                   help="global batch (default: the script's, from a 1-rank run)")
    p.add_argument("--batch-arg", default="data.batch_size", help="the script's per-rank batch option")
    p.add_argument("--cache", default=None, help=f"cache file (default ${layout_cache.CACHE_ENV} or"
                   f" ~/.cache/lightning_horizon/layouts.json)")
    p.add_argument("--no-cache", action="store_true", help="print the winner, do not store it")
    p.add_argument("script", type=_script, help="a LightningCLI training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def _inspect(a: argparse.Namespace, layouts: list[Layout]) -> ScriptShape:
    """How the tuner runs the script (read from its ``--print_config``); exits 2, before any layout runs, when it
    cannot."""
    try:
        return inspect_script(a.script, a.script_args, a.batch_arg if any(x.ranks > 1 for x in layouts) else None,
                              clean_env(), min(a.timeout, 300))
    except ScriptShapeError as e:
        print(f"tune: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _report(winner: Result, results: list[Result], machine: Machine, max_foreign: float) -> Layout:
    """Print the winner, a warning when neighbours took the machine, and how the untuned rule's layout compares;
    returns the rule's layout."""
    rep = winner.report
    rule, why = rule_layout(rep["param_bytes"], rep["largest_bytes"], machine, rep["workload"]["global_batch"],
                            node_free_memory())
    ran = next((r for r in results if r.layout == rule and r.status == "ok"), None)
    print(f"winner: {winner.layout} ({winner.throughput:,.0f} {winner.unit})")
    busy = max(r.foreign for r in results if r.status == "ok")
    if busy > max_foreign:
        print(f"warning: other processes took up to {100 * busy:.0f}% of the machine while layouts were measured:"
              " the choice may reflect the neighbours (a pool of several threads suffers most); tune again on a quiet"
              " machine")
    print(f"rule without tuning: {rule}" + (f" = {ran.throughput / winner.throughput:.2f}x the winner" if ran
                                            else " (not measured)") + f" [{why}]")
    return rule


def _cache(winner: Result, results: list[Result], rule: Layout, machine: Machine, cache: Optional[str]) -> None:
    """Store the winner and the whole table for this workload on this machine (``cache``: the file, or the
    default)."""
    path = layout_cache.cache_path(cache)
    layout_cache.store(winner.report["workload"], {
        "ranks": winner.layout.ranks, "threads": winner.layout.threads, "throughput": winner.throughput,
        "unit": winner.unit, "rule": str(rule),
        "table": [{"layout": str(r.layout), "status": r.status, "throughput": r.throughput,
                   "peak_rss": r.peak_rss, "foreign": r.foreign, "note": r.note} for r in results],
    }, path, machine)
    print(f"cached in {path}")


if __name__ == "__main__":
    main()
