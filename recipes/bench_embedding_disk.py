"""Benchmark: an embedding table larger than memory, its rows on disk with the hot rows cached, against the same
table in memory and against the same table in memory on a swap file.

    python recipes/bench_embedding_disk.py                          # root: 237M rows x 16 (15 GiB) under 1.5 GiB
    python recipes/bench_embedding_disk.py --zipf 0.8,1.0,1.2,uniform --steps 30
    python recipes/bench_embedding_disk.py --smoke                  # CI: 300k rows, a few steps, no limit, no swap

The model is the risk model's shape: ``--fields`` hashed id fields per sample, each id a row of one table of
``--rows`` x ``--dim`` (fp32, row-wise Adagrad: 68 bytes a row with its state at dim 16), the rows summed per
sample, a small MLP on top, a BCE loss; one process, the step written out (lookup, backward, the table's sparse
step, AdamW on the MLP); ``--prefill`` steps of a larger batch first fill the cache (every arm trains them). The ids: row ranks drawn from a Zipf law of exponent ``--zipf`` (``uniform``: every row
alike), scattered over the table by a multiplicative hash, as hashed feature ids are.

The arms, each a fresh process in a memory cgroup of its own (root; elsewhere without limits, said in the output):

- ``memory``: ``ShardedEmbeddingBag`` in memory, no limit: the speed to match, where the table fits;
- ``disk``: the same table with ``rows_on_disk=`` and ``cache_rows`` = ``--cache`` of the rows, under the limit
  ``--limit`` (memory and memory + swap alike): the rows and their optimizer state in files, the hot ones in memory;
- ``swap``: the table in memory under the same memory limit with a swap file of the table's size allowed
  (memory + swap = limit + the file): what a user without this would try. It is made (``fallocate``, ``mkswap``,
  ``swapon``) before the arm and removed after it.

Per arm and id law: samples/s (the median step after ``--warmup``), the cache's hit rate (rows a step needed that
were in memory, of all distinct rows it needed), rows read from and written to the files per step, the bytes the
process read from and wrote to the disk per step (``/proc/self/io``), and the cgroup's peak. The disk arm's state
equals the memory arm's bit for bit (tests/test_embedding.py); here the last step's loss is shown for both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _bench import cgroup_stats, cpu_line, parse_common, parse_size, probe_cgroup, run_cgroup  # noqa: E402

ARMS = ("memory", "disk", "swap")
MIB, GIB = 2**20, 2**30
SMOKE = dict(rows=300_000, steps=3, warmup=1, batch=64, arms="memory,disk", limit="0", zipf="1.0", prefill=1,
             cache=0.2)
PREFILL_BATCHES = 16  #: a prefill step's batch, in batches


# ---------------------------------------------------------------------------------------------- worker side


def sample_ids(n: int, fields: int, rows: int, law: str, g: Any) -> Any:
    """``[n, fields]`` row ids: ranks from a Zipf law of exponent ``law`` (inverse CDF of its continuous form) or
    uniform, scattered over the table by a multiplicative hash."""
    import torch

    u = torch.rand(n, fields, generator=g, dtype=torch.float64)
    if law == "uniform":
        return (u * rows).long().clamp_(max=rows - 1)
    s = float(law)
    if abs(s - 1.0) < 1e-9:
        ranks = torch.exp(u * torch.log(torch.tensor(float(rows))))
    else:
        ranks = ((rows ** (1 - s) - 1) * u + 1) ** (1 / (1 - s))
    return ((ranks.floor().long() - 1).clamp_(0, rows - 1) * 2654435761) % rows


def _io() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def worker(spec: dict[str, Any], out: str) -> None:
    from _bench import join_cgroup

    join_cgroup()
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightning_horizon.embedding import RowWiseAdagrad, ShardedEmbeddingBag
    from lightning_horizon.memory import peak_rss

    torch.manual_seed(0)
    rows, dim, fields, batch = spec["rows"], spec["dim"], spec["fields"], spec["batch"]
    disk = spec["arm"] == "disk"
    table = ShardedEmbeddingBag(rows, dim, mode="sum", optimizer=RowWiseAdagrad(lr=0.05), init_seed=0,
                                rows_on_disk=spec["folder"] if disk else None,
                                cache_rows=max(1, int(spec["cache"] * rows)) if disk else None)
    mlp = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    times, io, loss = [], [], 0.0
    t_start = time.perf_counter()
    counts = lambda c: (c.hits, c.misses, c.reads, c.writes) if c is not None else (0, 0, 0, 0)  # noqa: E731
    at_warmup = counts(None)
    prefill = spec["prefill"]
    for step in range(prefill + spec["warmup"] + spec["steps"]):
        if step == prefill + spec["warmup"]:
            at_warmup = counts(table.disk)
        n = batch * PREFILL_BATCHES if step < prefill else batch
        ids = sample_ids(n, fields, rows, spec["zipf"], g)
        y = torch.randint(0, 2, (n,), generator=g).float()
        before, t0 = _io(), time.perf_counter()
        loss_t = F.binary_cross_entropy_with_logits(mlp(table(ids)).squeeze(1), y)
        opt.zero_grad()
        loss_t.backward()
        table.take_gradient()
        table.sparse_step()
        opt.step()
        t1, after = time.perf_counter(), _io()
        loss = float(loss_t)
        if step >= prefill + spec["warmup"]:
            times.append(t1 - t0)
            io.append((after[0] - before[0], after[1] - before[1]))
        if time.perf_counter() - t_start > spec["budget_s"] and len(times) >= 1:
            break  # the swap arm: the steps it managed in its time
    cache = table.disk
    result = {
        "arm": spec["arm"], "zipf": spec["zipf"], "steps": len(times),
        "samples_per_s": batch / statistics.median(times), "step_s": statistics.median(times),
        "read_mib_per_step": statistics.mean(r for r, _ in io) / MIB,
        "write_mib_per_step": statistics.mean(w for _, w in io) / MIB, "peak_rss_mib": peak_rss() / MIB,
        "loss": loss,
    }
    if cache is not None:
        hits, misses, reads, writes = (now - then for now, then in zip(counts(cache), at_warmup))
        result.update({"hit_rate": hits / max(1, hits + misses), "cache_rows": cache.slots,
                       "rows_read_per_step": reads / len(times), "rows_written_per_step": writes / len(times),
                       "row_bytes": cache.row_bytes})
    Path(out).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- driver side


def _swap_on(nbytes: int, folder: Path) -> Optional[Path]:
    """A swap file of ``nbytes`` under ``folder`` (root), or None where one cannot be made."""
    path = folder / "bench.swap"
    try:
        subprocess.run(["fallocate", "-l", str(nbytes), str(path)], check=True, capture_output=True)
        os.chmod(path, 0o600)
        subprocess.run(["mkswap", str(path)], check=True, capture_output=True)
        subprocess.run(["swapon", str(path)], check=True, capture_output=True)
        return path
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"swap arm: no swap file ({e}); skipped", file=sys.stderr)
        path.unlink(missing_ok=True)
        return None


def _swap_off(path: Path) -> None:
    subprocess.run(["swapoff", str(path)], check=False, capture_output=True)
    path.unlink(missing_ok=True)


def run_arm(a: argparse.Namespace, arm: str, law: str, work: Path) -> dict[str, Any]:
    table_bytes = a.rows * (a.dim * 4 + 4)  # fp32 rows and their row-wise Adagrad accumulator
    spec = {"arm": arm, "rows": a.rows, "dim": a.dim, "fields": a.fields, "batch": a.batch, "zipf": law,
            "steps": a.steps, "warmup": a.warmup, "prefill": a.prefill, "cache": a.cache,
            "folder": str(work / "tables"),
            "budget_s": a.timeout * 0.6}
    limit = parse_size(a.limit) or None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    swap = _swap_on(int(table_bytes * 1.2), work) if arm == "swap" else None
    if arm == "swap" and swap is None:
        return {"arm": arm, "zipf": law, "skipped": "no swap file"}
    out = work / f"{arm}-{law}.json"
    try:
        with run_cgroup(env, "bench_emb_disk", None if arm == "memory" else limit,
                        swap=int(table_bytes * 1.2) if swap else 0) as cg:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec), "--out", str(out)]
            proc = subprocess.run(cmd, env=env, timeout=a.timeout, capture_output=True, text=True)
            stats = cgroup_stats(cg) if cg else None
    except subprocess.TimeoutExpired:
        return {"arm": arm, "zipf": law, "failed": f"timed out after {a.timeout:.0f} s"}
    finally:
        if swap is not None:
            _swap_off(swap)
        shutil.rmtree(work / "tables", ignore_errors=True)
    if proc.returncode != 0 or not out.exists():
        return {"arm": arm, "zipf": law, "failed": f"exit {proc.returncode}: {proc.stderr[-1500:]}",
                "cgroup": stats}
    result = json.loads(out.read_text())
    result["cgroup"], result["limit"] = stats, cg.limit if cg else None
    return result


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=237_000_000, help="rows of the table (default: 15 GiB with its state)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--fields", type=int, default=8, help="id fields per sample")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--zipf", default="1.0", help="comma-separated exponents, or 'uniform'")
    p.add_argument("--cache", type=float, default=0.05, help="the disk arm's cache, a share of the rows")
    p.add_argument("--limit", default="1.5GiB", help="memory limit of the disk and swap arms (0: none)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--prefill", type=int, default=0,
                   help=f"steps of {PREFILL_BATCHES}x the batch before the warm-up (trained alike in every arm): a"
                        " cache of millions of rows fills in thousands of ordinary steps")
    a = parse_common(p, argv, SMOKE, worker, corpus=False)
    if a is None:
        return
    arms = a.arms.split(",")
    limit = parse_size(a.limit) or None
    cg = probe_cgroup("bench_emb_disk", limit) if limit else None
    table = a.rows * (a.dim * 4 + 4)
    print(cpu_line(f"table {a.rows:,} x {a.dim} fp32 + row-wise Adagrad = {table / GIB:.2f} GiB,"
                   f" cache {a.cache:.0%} of the rows, batch {a.batch} x {a.fields} ids,"
                   f" limit {'none' if not limit else f'{limit / MIB:,.0f} MiB'}"
                   f"{'' if cg or not limit else ' (no cgroup here: not enforced)'}"))
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_emb_disk_", dir=os.environ.get("BENCH_DIR")) as tmp:
        for law in a.zipf.split(","):
            row = {}
            for arm in arms:
                r = run_arm(a, arm, law, Path(tmp))
                results.append(r)
                row[arm] = r
                print(_line(r, row.get("memory")), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


def _line(r: dict[str, Any], ref: Optional[dict[str, Any]]) -> str:
    head = f"zipf {r['zipf']:>7} | {r['arm']:<6} | {r.get('steps', 0):>3} steps"
    if "failed" in r or "skipped" in r:
        return f"{head} | {r.get('failed') or r.get('skipped')}"
    parts = [f"{r['samples_per_s']:>10,.0f} samples/s"]
    if ref and "samples_per_s" in ref and r is not ref:
        parts.append(f"{r['samples_per_s'] / ref['samples_per_s']:.2f}x memory")
    if "hit_rate" in r:
        parts.append(f"hit rate {r['hit_rate']:.1%}, {r['rows_read_per_step']:,.0f} rows read and"
                     f" {r['rows_written_per_step']:,.0f} written a step")
    parts.append(f"disk {r['read_mib_per_step']:.1f} MiB read, {r['write_mib_per_step']:.1f} MiB written a step")
    peak = (r.get("cgroup") or {}).get("peak")
    parts.append(f"peak {peak / MIB:,.0f} MiB (cgroup)" if peak else f"peak RSS {r['peak_rss_mib']:,.0f} MiB")
    parts.append(f"loss {r['loss']:.4f}")
    return f"{head} | " + " | ".join(parts)


if __name__ == "__main__":
    main()
