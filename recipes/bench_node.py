"""One run on a many-core node: the layout the tuner picks against every Lightning layout, and where a step's time
goes at one process and at the tuned layout.

    python recipes/bench_node.py --out runs/node                  # about 15 minutes on 16 cores
    python recipes/bench_node.py --quick --out /tmp/node          # CI: every stage at one layout, tiny.yaml

On a 16-core Xeon VM (torch 2.11) each layout the tuner tries and each benchmark arm took about 40 s, most of it
process start (imports, the script's setup), not the measured steps: the stages below need about 15 minutes;
``--budget`` shortens the run (the later stages are skipped first).

Stages, each a child process with its own time limit, most telling first; a stage that would not fit in what is
left of ``--budget`` is skipped and says so, and every finished stage is in OUT at once (a run cut short keeps
them):

1. ``python -m lightning_horizon.tune`` on the small config at the global batch ``--batch`` (a config written to
   OUT), every candidate layout of the machine, into OUT/layouts.json (its own cache: the user's is untouched);
2. ``bench_vs_lightning.py --layouts``: Lightning's bf16-mixed (where the CPU has native bf16) and horizon's
   defaults at three layouts (one process on every core, the middle candidate, one thread per rank), Lightning's
   32-true at its default layout (one process), and ``horizon-tuned``, which reads OUT/layouts.json: the tuned
   layout against Lightning's default and its best layout tried;
3. ``profile_step.py`` at one process on every core and at the tuned layout: the categories of a step, MFU;
4. the tuner on the 125M config at two layouts (one process; ranks of 4 threads), 1 + 2 steps each (its table is
   ``layouts_125m`` in node.json).

Then OUT/node.json (the machine, each stage's result, command, seconds and log tail) and a table. Each stage's
whole log is OUT/<stage>.log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _run(name: str, cmd: list[str], out: Path, env: dict[str, str], limit: float) -> dict[str, Any]:
    """Run one stage's command (its own process group, killed at ``limit`` seconds); its log in OUT/name.log."""
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = "timeout"
    tail = (out / f"{name}.log").read_text(errors="replace")[-4000:]
    print(f"== {name}: exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
    return {"command": " ".join(cmd), "rc": rc, "seconds": time.monotonic() - t0, "log_tail": tail}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/node", help="folder for node.json, the stages' logs and JSON")
    p.add_argument("--budget", type=float, default=900, help="seconds for the whole run")
    p.add_argument("--batch", type=int, default=64, help="global batch of the small config (sequences of 256)")
    p.add_argument("--quick", action="store_true", help="the plumbing: tiny.yaml, the layout 1xN only, 1 + 2 steps,"
                   " no 125M stage")
    p.add_argument("--cache-dir", default=None, help="token cache (default ~/.cache/lightning_horizon)")
    a = p.parse_args(argv)
    if not a.budget > 0 or a.batch < 1:
        p.error(f"--budget={a.budget} --batch={a.batch}: allowed are a budget > 0 seconds and a batch >= 1")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.budget

    import yaml

    from lightning_horizon.layout import Machine, candidates
    from lightning_horizon.layout.tuner import clean_env

    machine = Machine.here()
    n, q = machine.cores, a.quick
    cfg = yaml.safe_load((HERE / "configs" / ("tiny.yaml" if q else "small.yaml")).read_text())
    cfg.setdefault("data", {})["batch_size"] = a.batch
    config = out / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {**clean_env(), "HORIZON_LAYOUT_CACHE": str(out / "layouts.json"),  # a clean shell, as tune's workers
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    py, gpt_script = sys.executable, str(HERE / "pretrain_gpt.py")
    every = candidates(n, machine.domains)  # the bench: one process, the middle layout, one thread per rank
    bench_layouts = ",".join(sorted({f"{x.ranks}x{x.threads}" for x in (every[0], every[len(every) // 2], every[-1])}))
    tune_layouts = "all"
    if q:
        tune_layouts = bench_layouts = f"1x{n}"
    steps = ["--warmup", "1", "--steps", "2"] if q else ["--warmup", "2", "--steps", "4"]
    cache = ["--cache-dir", a.cache_dir] if a.cache_dir else []
    script_cache = ["--data.cache_dir", a.cache_dir] if a.cache_dir else []
    bench = out / "bench.json"
    result: dict[str, Any] = {"machine": machine.describe(), "cores": n, "batch": a.batch, "config": cfg,
                              "stages": {}}

    def stage(name: str, cmd: list[str], least: float, most: float = float("inf")) -> Optional[dict[str, Any]]:
        left = deadline - time.monotonic()
        if left < least:
            result["stages"][name] = {"skipped": f"{left:.0f} s left, needs {least:.0f}"}
            print(f"== {name}: skipped ({left:.0f} s left)", flush=True)
            return None
        result["stages"][name] = st = _run(name, cmd, out, env, min(most, left))
        (out / "node.json").write_text(json.dumps(result, indent=1, default=str))
        return st

    stage("tune-small", [py, "-m", "lightning_horizon.tune", "--layouts", tune_layouts, "--retries", "0", *steps,
                         gpt_script, "--config", str(config), *script_cache], 60, 0.35 * a.budget)
    if (out / "layouts.json").exists():  # the small config's tuning (the 125M one is stored later)
        result["layouts"] = json.loads((out / "layouts.json").read_text())
    stage("bench", [py, str(HERE / "bench_vs_lightning.py"), "--config", str(config), "--layouts", bench_layouts,
                    "--layout-arms", "lightning-32" if q else "lightning-bf16,horizon",
                    *([] if q else ["--arms", "lightning-32"]), "--rounds", "1", "--retries", "0", "--timeout", "150",
                    *(["--warmup", "1", "--steps", "3"] if q else steps), "--peak-seconds", "0.3" if q else "1.0",
                    "--json", str(bench), *cache], 90, 0.45 * a.budget)
    if bench.exists():
        result["bench"] = json.loads(bench.read_text())
    tuned = _tuned(result.get("layouts"))
    for ranks, threads in dict.fromkeys([(1, n), *([tuned] if tuned else [])]):
        name = f"profile-{ranks}x{threads}"
        js = out / f"{name}.json"
        st = stage(name, [py, str(HERE / "profile_step.py"), "--config", str(config), "--devices", str(ranks),
                          "--threads-per-rank", str(threads),
                          *(["--warmup", "2", "--steps", "2"] if q else ["--warmup", "4", "--steps", "3"]),
                          "--peak-seconds", "0.3" if q else "0.5", "--json", str(js), *cache], 45)
        if st is not None and js.exists():
            st["result"] = {k: v for k, v in json.loads(js.read_text()).items() if k != "top_ops"}
    if not q:
        stage("tune-125m", [py, "-m", "lightning_horizon.tune", "--layouts", f"1x{n},{max(1, n // 4)}x4", "--retries",
                            "0", "--warmup", "1", "--steps", "2", gpt_script, "--config",
                            str(HERE / "configs" / "125m.yaml"), *script_cache], 60)
        if (out / "layouts.json").exists():
            result["layouts_125m"] = json.loads((out / "layouts.json").read_text())
    (out / "node.json").write_text(json.dumps(result, indent=1, default=str))
    print(summary(result))
    return result


def _tuned(cache: Optional[dict[str, Any]]) -> Optional[tuple[int, int]]:
    """The first tuned layout in a layout cache file (the small config's: the first stage that stores one)."""
    for entry in _entries(cache):
        return entry["ranks"], entry["threads"]
    return None


def _entries(cache: Any) -> list[dict[str, Any]]:
    """Every stored tuning in a layout cache file, in the order stored (any nesting the cache uses)."""
    if isinstance(cache, dict):
        if {"ranks", "threads", "table"} <= cache.keys():
            return [cache]
        return [e for v in cache.values() for e in _entries(v)]
    return []


def summary(result: dict[str, Any]) -> str:
    """The printed table: each stage's outcome, the tuner's tables, the bench's rows against Lightning's default
    and best layouts, the profiles' MFU and largest categories."""
    lines = [f"machine: {result['machine']} | global batch {result['batch']} x"
             f" {result['config'].get('data', {}).get('seq_len', 256)} tokens"]
    for name, st in result["stages"].items():
        lines.append(f"  {name}: " + (f"skipped ({st['skipped']})" if "skipped" in st else
                                      f"exit {st['rc']} in {st['seconds']:.0f} s"))
    for entry in _entries(result.get("layouts_125m") or result.get("layouts")):
        w = entry.get("workload", {})
        shape = "x".join(str(w.get("hparams", {}).get(k)) for k in ("n_layer", "n_embd"))
        lines.append(f"tuned ({shape}, {w.get('global_batch')} x {w.get('seq_len')}): {entry['ranks']}x"
                     f"{entry['threads']} (rule {entry.get('rule')}): " + ", ".join(
            f"{r['layout']} {r['throughput'] or 0:,.0f}" for r in entry["table"]) + f" {entry.get('unit', '')}")
    rows = (result.get("bench") or {}).get("rows", [])
    if rows:
        lines.append("| arm | tok/s | MFU bf16 | MFU fp32 |\n|---|---|---|---|")
        for r in sorted(rows, key=lambda r: -r["tokens_per_sec"]):
            lines.append(f"| {r['arm']} | {r['tokens_per_sec']:,.0f} | {_pct(r.get('mfu_bf16'))} |"
                         f" {_pct(r.get('mfu_fp32'))} |")
        light = [r for r in rows if r["kind"] == "lightning"]
        default = [r for r in light if "@" not in r["arm"] or r["arm"].endswith(f"@1x{result['cores']}")]
        tuned = next((r for r in rows if r["arm"] == "horizon-tuned"), None)
        if tuned and light and default:
            best, dflt = max(light, key=lambda r: r["tokens_per_sec"]), max(default, key=lambda r: r["tokens_per_sec"])
            lines.append(f"horizon-tuned / best Lightning layout ({best['arm']}):"
                         f" {tuned['tokens_per_sec'] / best['tokens_per_sec']:.2f}x; / Lightning's default layout"
                         f" ({dflt['arm']}): {tuned['tokens_per_sec'] / dflt['tokens_per_sec']:.2f}x")
    for name, st in result["stages"].items():
        res = st.get("result")
        if res:
            top = sorted(res["rows_share"].items(), key=lambda kv: -kv[1])[:5]
            lines.append(f"{name}: {res['tokens_per_sec']:,.0f} tok/s, MFU {100 * res['mfu']:.0f}% of the"
                         f" {res['compute']} peak; " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in top))
    return "\n".join(lines)


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


if __name__ == "__main__":
    main()
