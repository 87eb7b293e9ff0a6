"""Benchmark: a replicated dense embedding table against ShardedEmbeddingBag, at 2 and 4 ranks of one node.

    python recipes/bench_embedding.py                                    # 10M rows x 16, 2 and 4 ranks, 2 rounds
    python recipes/bench_embedding.py --rows 2000000 --ranks 4 --rounds 1
    python recipes/bench_embedding.py --smoke                            # CI: 10k rows, 2 ranks, 3 steps
    python recipes/bench_embedding.py --nodes 2 --ranks 4 --arms sharded,sharded-node --rate 1gbit  # root
    python recipes/bench_embedding.py --nodes 2 --ranks 4 --arms sharded,sharded-node,sharded-auto --rows 20000 \
        --fields 256                         # root: a small table looked up many times per sample

The model is a DLRM-style click/risk model: ``--fields`` id fields per sample (each id one row of one shared table of
``--rows`` x ``--dim``, the rows summed per sample: an embedding bag), 13 dense features, an MLP. The data: ids drawn
from a Zipf law over the rows (as hashed ids of real features are: a few hot, most rare), random labels (the step's
cost does not depend on them). The arms:

- ``dense``: what the recipe does without a sharded table and what a user writes first: ``nn.EmbeddingBag`` under
  Lightning's own ``"ddp"`` with ``torch.optim.AdamW(fused=True)`` on everything: every rank holds the table, its
  gradient and two moments, DDP all-reduces the whole table's gradient every step, AdamW updates every row;
- ``sharded``: ``ShardedEmbeddingBag`` (row-wise Adagrad; ``init_seed``, so each rank draws only its own rows) under
  ``HorizonStrategy``, the MLP with the same AdamW;
- ``sharded``: spread over the world's ranks (``span="world"``);
- ``sharded-node``: the same with ``span="node"`` (a copy of the table per node, lookups inside the node, the touched
  rows' gradients summed across nodes): the same as ``sharded`` on one node;
- ``sharded-auto``: the same with ``span="auto"`` (the default: spread, or moved to a copy per node at the first
  lookup where the measured links and that batch's ids predict it cheaper); its row says what it chose;
- ``torchrec``: TorchRec's sharded ``EmbeddingBagCollection`` where it installs beside this torch; otherwise the
  line says why it is skipped.

Per arm and rank count, in the same run (the arms alternate, rounds rotate their order): samples/s (global batch over
the median step after ``--warmup`` steps; the median over rounds), the bytes of the table and its optimizer state per
rank (the tensors themselves: weight, its gradient where one is kept, the optimizer's state for it), peak RSS per
rank (``VmHWM``, the largest rank), and the bytes one rank sent in the last step for the table and in all (dense: the
ring all-reduce of the gradients, 2(R-1)/R of their bytes; sharded: what its lookups sent, counted by the module,
and our comm hook's count of the MLP's all-reduce). Every run is a fresh process group (Lightning's launcher starts
the other ranks), killed on timeout. ``--nodes 2`` runs each arm as 2 emulated nodes (one Lightning launch each,
``NODE_RANK``): as root in two network namespaces joined by a veth capped at ``--rate`` by tc's tbf, else on
loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _bench import Namespaces, cpu_line, default_burst, parse_common, run_launches  # noqa: E402

ARMS = ("dense", "sharded", "sharded-node", "sharded-auto", "torchrec")
SPANS = {"sharded": "world", "sharded-node": "node", "sharded-auto": "auto"}
N_DENSE = 13
MIB = 2**20
SMOKE = dict(rows=10_000, ranks="2", steps=3, warmup=1, rounds=1, batch=64)


# ---------------------------------------------------------------------------------------------- worker side


def worker(spec: dict[str, Any], out: str) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from lightning_horizon import HorizonStrategy
    from lightning_horizon.embedding import RowWiseAdagrad, ShardedEmbeddingBag
    from lightning_horizon.memory import peak_rss

    rows, dim, fields, batch = spec["rows"], spec["dim"], spec["fields"], spec["batch"]

    class Clicks(Dataset):
        """Ids from a Zipf law over the rows (a hashed feature's: few hot, most rare), dense features, labels."""

        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(0)
            ranks = torch.rand(n, fields, generator=g).pow(-1 / 0.2)  # Pareto(0.2): heavy-tailed row ranks
            self.ids = (ranks.floor().long() * 2654435761) % rows  # scattered over the table, as a hash would
            self.dense = torch.randn(n, N_DENSE, generator=g)
            self.y = torch.randint(0, 2, (n,), generator=g).float()

        def __len__(self) -> int:
            return len(self.y)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
            return self.ids[i], self.dense[i], self.y[i]

    class Risk(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if spec["arm"].startswith("sharded"):
                # seeded: each rank draws only the rows it holds, never the whole table
                self.table = ShardedEmbeddingBag(rows, dim, mode="sum", optimizer=RowWiseAdagrad(lr=0.05),
                                                 init_seed=0, span=SPANS[spec["arm"]])
            else:
                self.table = nn.EmbeddingBag(rows, dim, mode="sum")
            self.mlp = nn.Sequential(nn.Linear(N_DENSE + dim, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                                     nn.Linear(128, 1))

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            ids, dense, y = b
            logits = self.mlp(torch.cat([dense, self.table(ids)], 1)).squeeze(1)
            return F.binary_cross_entropy_with_logits(logits, y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    class Probe(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.sent, self.sent_rest = 0.0, 0.0  # the table's bytes, the rest's (one rank, the last step)

        def on_train_batch_end(self, trainer: Any, module: Any, *_: Any) -> None:
            self.ends.append(time.perf_counter())
            comm = getattr(trainer.strategy, "comm_metrics", None)
            if comm is not None:  # sharded: the lookups' bytes, and DDP's all-reduce of the rest (our comm hook's)
                m = comm()
                self.sent = m.get("comm/embedding_bytes", 0.0)
                self.sent_rest = m.get("comm/intra_bytes", 0.0) + m.get("comm/inter_bytes", 0.0)

        def on_train_end(self, trainer: Any, module: Any) -> None:
            table = module.table.weight
            state = [t for k, t in getattr(module.table, "optimizer_state", {}).items()]
            opt = trainer.optimizers[0]
            state += [v for v in opt.state.get(table, {}).values() if torch.is_tensor(v) and v.dim()]
            grad = table.grad.numel() * table.element_size() if table.grad is not None else 0
            if spec["arm"] == "dense":  # DDP keeps the table's gradient (in its buckets) between steps too
                grad = table.numel() * table.element_size()
                ring = 2 * (trainer.world_size - 1) / trainer.world_size  # what a ring all-reduce sends per rank
                self.sent = ring * grad
                self.sent_rest = ring * sum(p.numel() * p.element_size() for p in module.mlp.parameters())
            mine = {"table_bytes": table.numel() * table.element_size() + grad
                    + sum(t.numel() * t.element_size() for t in state), "rss": peak_rss(), "sent": self.sent,
                    "sent_all": self.sent + self.sent_rest, "copies": getattr(module.table, "copies", 1)}
            everyone = [None] * trainer.world_size
            torch.distributed.all_gather_object(everyone, mine)
            if trainer.global_rank == 0:
                Path(out).write_text(json.dumps({"ends": self.ends, "ranks": everyone}))

    torch.manual_seed(0)
    strategy = HorizonStrategy(threads_per_rank=spec["threads"]) if spec["arm"] != "dense" else "ddp"
    if spec["arm"] == "dense":
        torch.set_num_threads(spec["threads"])
    probe = Probe()
    nodes = spec["nodes"]  # emulated nodes: one launch each (NODE_RANK), its launcher starts the node's ranks
    trainer = L.Trainer(accelerator="cpu", devices=spec["ranks"] // nodes, num_nodes=nodes, strategy=strategy,
                        max_steps=spec["steps"], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[probe])
    data = Clicks(batch * spec["ranks"] * spec["steps"])
    trainer.fit(Risk(), DataLoader(data, batch_size=batch))


def torchrec_missing() -> Optional[str]:
    """Why the TorchRec arm cannot run here, or None."""
    try:
        import torchrec  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure (missing, or built for another torch) skips it
        return (f"torchrec does not import here ({type(err).__name__}: {str(err).splitlines()[0][:160]}); its CPU"
                " wheels (torchrec + fbgemm-gpu-cpu) are built for one torch release each")
    return "torchrec imports, but its arm is not written yet"


# ---------------------------------------------------------------------------------------------- driver side


def run(spec: dict[str, Any], timeout: float, ns: Optional[Namespaces] = None) -> Optional[dict[str, Any]]:
    """One arm in fresh processes: one launch, or one per emulated node (in ``ns``'s namespaces, or on loopback)."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    from lightning_horizon.layout.tuner import run_worker

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, __file__, "--worker", json.dumps(spec), "--out", str(out)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(find_free_network_port())}
        launches = []
        for node in range(spec["nodes"]):
            prefix, extra = ns.command(node) if ns else ([], {"MASTER_ADDR": "127.0.0.1"})
            launches.append(([*prefix, *cmd], {**env, "NODE_RANK": str(node), **extra}))
        if spec["nodes"] > 1:
            codes, logs = run_launches(launches, timeout)
            code, log = max(abs(c) for c in codes), "\n".join(logs)
        else:
            code, log = run_worker(cmd, env, timeout)
        if code or not out.exists():
            print(f"  {spec['arm']} x{spec['ranks']} failed (exit {code}):\n{log[-3000:]}", flush=True)
            return None
        for line in log.splitlines():  # span="auto"'s choice, as rank 0 logged it
            if "span='auto'" in line:
                print(f"    {line.strip()}", flush=True)
        report = json.loads(out.read_text())
    ends = report["ends"][spec["warmup"] - 1:]
    step = statistics.median(b - a for a, b in zip(ends, ends[1:]))
    ranks = report["ranks"]
    return {"samples_s": spec["batch"] * spec["ranks"] / step, "table_mib": max(r["table_bytes"] for r in ranks) / MIB,
            "rss_mib": max(r["rss"] for r in ranks) / MIB, "sent_mib": max(r["sent"] for r in ranks) / MIB,
            "sent_all_mib": max(r["sent_all"] for r in ranks) / MIB, "copies": ranks[0]["copies"]}


def span_of(arm: str, result: dict[str, Any]) -> str:
    """What ``span="auto"`` chose, for its row: ``" (node)"``, a copy per node, or ``" (world)"``."""
    return f" ({'node' if result['copies'] > 1 else 'world'})" if arm == "sharded-auto" else ""


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000, help="rows of the table")
    p.add_argument("--dim", type=int, default=16, help="width of a row")
    p.add_argument("--fields", type=int, default=26, help="ids per sample (one bag)")
    p.add_argument("--batch", type=int, default=512, help="samples per rank and step")
    p.add_argument("--ranks", default="2,4", help="rank counts, comma-separated")
    p.add_argument("--arms", default="dense,sharded,torchrec", help=f"of {ARMS}")
    p.add_argument("--steps", type=int, default=12, help="steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="steps before the timing starts")
    p.add_argument("--rounds", type=int, default=2, help="rounds (each runs every arm once, in rotated order)")
    p.add_argument("--nodes", type=int, default=1, help="emulated nodes (2: network namespaces as root, else loopback)")
    p.add_argument("--rate", default="1gbit", help="with --nodes 2 as root: the tbf cap of the link between them")
    p.add_argument("--no-netns", action="store_true", help="with --nodes 2: on loopback even as root")
    a = parse_common(p, argv, SMOKE, worker, corpus=False)
    if a is None:
        return  # a worker: it ran
    arms = a.arms.split(",")
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        p.error(f"--arms: {unknown} not among {ARMS}")
    if a.warmup < 1 or a.steps < a.warmup + 2:
        p.error(f"--steps {a.steps} --warmup {a.warmup}: allowed is warmup >= 1 and steps >= warmup + 2")
    cores = os.cpu_count() or 1
    print(cpu_line(f"table {a.rows:,} x {a.dim} fp32 ({a.rows * a.dim * 4 / MIB:,.0f} MiB), {a.fields} ids per"
                   f" sample, batch {a.batch} per rank"), flush=True)
    if "torchrec" in arms:
        print(f"torchrec: skipped: {torchrec_missing()}", flush=True)
        arms.remove("torchrec")
    bad = [x for x in a.ranks.split(",") if int(x) % a.nodes]
    if a.nodes not in (1, 2) or bad:
        p.error(f"--nodes {a.nodes} --ranks {a.ranks}: allowed is 1 or 2 nodes, each rank count a multiple of them")
    results: dict[tuple[str, int], list[dict]] = {}
    with ExitStack() as stack:
        ns = None
        if a.nodes == 2 and not a.no_netns and os.geteuid() == 0 and shutil.which("ip"):
            ns = stack.enter_context(Namespaces())
            print(f"2 emulated nodes: network namespaces joined by a veth capped at {a.rate} (tbf)"
                  if ns.shape(a.rate, default_burst(a.rate)) else "2 emulated nodes: the link is not capped")
        elif a.nodes == 2:
            print("2 emulated nodes on loopback (--no-netns, not root, or no iproute2): no link cap")
        for r in range(a.rounds):
            for ranks in [int(x) for x in a.ranks.split(",")]:
                order = arms[r % len(arms):] + arms[:r % len(arms)]
                for arm in order:
                    spec = {"arm": arm, "ranks": ranks, "threads": max(1, cores // ranks), "rows": a.rows,
                            "dim": a.dim, "fields": a.fields, "batch": a.batch, "steps": a.steps, "warmup": a.warmup,
                            "nodes": a.nodes}
                    res = run(spec, a.timeout, ns)
                    if res is not None:
                        results.setdefault((arm, ranks), []).append(res)
                        print(f"  round {r + 1} {arm}{span_of(arm, res)} x{ranks}: {res['samples_s']:,.0f}"
                              " samples/s", flush=True)
    rows = []
    print("\n| arm | ranks | samples/s (min-max) | table + state per rank | peak RSS per rank | sent per rank"
          " and step: table / all |\n|---|---|---|---|---|---|")
    for (arm, ranks), rs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        speeds = [x["samples_s"] for x in rs]
        rows.append({"arm": arm, "ranks": ranks, **med, "rounds": rs})
        print(f"| {arm}{span_of(arm, rs[-1])} | {ranks} | {med['samples_s']:,.0f}"
              f" ({min(speeds):,.0f}-{max(speeds):,.0f}) |"
              f" {med['table_mib']:,.1f} MiB | {med['rss_mib']:,.0f} MiB | {med['sent_mib']:,.3f} /"
              f" {med['sent_all_mib']:,.3f} MiB |")
    for ranks in sorted({k[1] for k in results}):
        d, s = results.get(("dense", ranks)), results.get(("sharded", ranks))
        if d and s:
            md = {k: statistics.median(x[k] for x in d) for k in d[0]}
            ms = {k: statistics.median(x[k] for x in s) for k in s[0]}
            print(f"{ranks} ranks, sharded / dense: samples/s {ms['samples_s'] / md['samples_s']:.2f}x, table +"
                  f" state per rank {ms['table_mib'] / md['table_mib']:.3f}x, peak RSS"
                  f" {ms['rss_mib'] / md['rss_mib']:.2f}x, bytes sent for the table"
                  f" {ms['sent_mib'] / md['sent_mib']:.5f}x"
                  f" (all {ms['sent_all_mib'] / md['sent_all_mib']:.5f}x)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
