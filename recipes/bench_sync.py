"""Benchmark: the cross-node sync of the recipe's GPT on emulated nodes, synchronous against periodic and overlapped.

    python recipes/bench_sync.py                                    # as root: 1 Gbit/s, 2 nodes x 1 rank, H = 2, 4
    python recipes/bench_sync.py --rate 100mbit --periods 4 --steps 24
    python recipes/bench_sync.py --arms sync,local_sgd,overlap --periods 4
    python recipes/bench_sync.py --nodes 4 --arms sync,local_sgd,overlap --periods 4   # 4 nodes on a bridge
    python recipes/bench_sync.py --smoke                            # CI: loopback, tiny GPT, seconds

The arms (``--arms``), each a ``HorizonStrategy(collectives="hierarchical", ...)``:

- ``sync``: gradients all-reduced across the nodes every step (hierarchical: inside the node, then across);
- ``local_sgd``: ``sync_every=H``, the nodes' weights averaged every H steps, everyone waiting for the average;
- ``diloco``: ``sync_every=H, outer="nesterov"``: DiLoCo's outer step at every sync, blocking;
- ``overlap``: ``sync_every=H, sync_overlap=True``: the average's exchange runs behind the next H steps and is
  applied one period late, on top of what each node trained meanwhile;
- ``overlap_nesterov``: ``sync_every=H, outer="nesterov", sync_overlap=True``.

Every periodic arm runs once per H of ``--periods``. As root with iproute2, each of the ``--nodes`` emulated nodes
is a network namespace; two are joined by a veth pair, more by a bridge (a switch in a namespace of its own, one
veth port per node), every link capped at ``--rate`` by tc's tbf in both directions (recipes/_bench.py, as
bench_collectives.py does); each node is one Lightning launch (``num_nodes``, ``NODE_RANK``), whose launcher starts
that node's other ranks inside the namespace. Without root (or with ``--no-netns``) all nodes run as one launch on
loopback (``ranks_per_node``), with no link to cap: figures for a smoke test, not for reading.

Each arm trains GPTPretrain (recipes/pretrain_gpt.py; ``--config``'s model, the byte corpus of recipes/lm_data.py,
the same seed and global batch in every arm) for ``--warmup`` + ``--steps`` steps on ``--threads`` threads per rank.
Tokens/s is over the measured steps as a whole (the measured steps should be a multiple of every H: a period's sync
step is slower than its other steps), rank 0's clock. The loss is the global batch's (the mean over every rank's
loss, each node on its own weights between syncs), averaged over the last ``--loss-steps`` steps: every arm sees the
same batches in the same order, so the same tokens. Rounds (``--rounds``) run every arm once each, in a rotated
order; the table shows the median over the rounds (min-max), each arm against ``sync`` and each overlapped arm
against ``local_sgd`` at the same H, and the share of a ``sync`` step that was communication (its step time against
the fastest periodic arm's non-sync steps is not measured: the share printed is 1 - tokens/s of ``sync`` over the
best arm's, an upper bound on what syncing less can save).
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
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # _bench.py, gpt.py, lm_data.py, pretrain_gpt.py

from _bench import Namespaces, cpu_line, default_burst, run_launches  # noqa: E402

ARMS = {
    "sync": {},
    "local_sgd": {"outer": "average", "sync_overlap": False},
    "diloco": {"outer": "nesterov", "sync_overlap": False},
    "overlap": {"outer": "average", "sync_overlap": True},
    "overlap_nesterov": {"outer": "nesterov", "sync_overlap": True},
}
DEFAULT_ARMS = "sync,local_sgd,overlap,overlap_nesterov"
SMOKE = dict(config=str(HERE / "configs" / "tiny.yaml"), warmup=1, steps=4, rounds=1, periods="2", loss_steps=2,
             arms="sync,overlap_nesterov", batch=4, max_bytes=2**20)


# ---------------------------------------------------------------------------------------------- worker side


def worker(spec: dict[str, Any], out: str) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_horizon import HorizonStrategy
    from lm_data import ByteCorpusDataModule
    from pretrain_gpt import GPTPretrain

    class Timer(Callback):
        """Rank 0: the time at every batch end and the global batch's loss (every rank's, averaged)."""

        def __init__(self) -> None:
            self.ends: list[float] = []
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")
            self.ends.append(time.perf_counter())
            self.losses.append(float(loss))

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.global_rank == 0:
                waits = trainer.strategy.comm_metrics().get("comm/outer_wait_s")
                Path(out).write_text(json.dumps({"ends": self.ends, "losses": self.losses, "outer_wait_s": waits}))

    L.seed_everything(1337, verbose=False)
    torch.set_num_threads(spec["threads"])
    kwargs = dict(spec["strategy"])
    if spec["loopback"]:
        kwargs["ranks_per_node"] = spec["per_node"]
    strategy = HorizonStrategy(collectives="hierarchical", threads_per_rank=spec["threads"], **kwargs)
    loopback, nodes = spec["loopback"], spec["nodes"]
    trainer = L.Trainer(
        accelerator="cpu", devices=spec["per_node"] * (nodes if loopback else 1), num_nodes=1 if loopback else nodes,
        strategy=strategy, max_steps=spec["steps"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[Timer()],
    )
    trainer.fit(GPTPretrain(**spec["model"]), ByteCorpusDataModule(**spec["data"]))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------- driver side


def arm_specs(a: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(name, HorizonStrategy keywords) for every arm and period asked for."""
    out = []
    for arm in a.arms:
        if arm == "sync":
            out.append(("sync", {}))
            continue
        for h in a.periods:
            out.append((f"{arm}-H{h}", {"sync_every": h, **ARMS[arm]}))
    return out


def run_arm(name: str, strategy: dict[str, Any], a: argparse.Namespace, ns: Optional[Namespaces],
            tmp: Path) -> dict[str, Any]:
    """One arm in fresh processes: one launch per emulated node (or one on loopback)."""
    import yaml

    cfg = yaml.safe_load(Path(a.config).read_text())
    data = {**cfg.get("data", {}), "batch_size": a.batch, "cache_dir": a.cache_dir}
    if a.max_bytes:
        data["max_bytes"] = a.max_bytes
    out = tmp / f"{name}.json"
    out.unlink(missing_ok=True)
    spec = {"strategy": strategy, "nodes": a.nodes, "per_node": a.per_node, "threads": a.threads,
            "loopback": ns is None, "steps": a.warmup + a.steps, "model": cfg.get("model", {}), "data": data}
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    port = str(find_free_network_port())  # free now: one derived from the pid can be another run's
    launches = []
    for node in range(1 if ns is None else a.nodes):
        prefix, extra = ns.command(node) if ns else ([], {"MASTER_ADDR": "127.0.0.1"})
        env = {**os.environ, "MASTER_PORT": port, "NODE_RANK": str(node), "OMP_NUM_THREADS": str(a.threads), **extra}
        launches.append(([*prefix, sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec),
                          "--out", str(out)], env))
    t0 = time.perf_counter()
    codes, logs = run_launches(launches, a.timeout)
    wall = time.perf_counter() - t0
    if any(codes) or not out.exists():
        tail = " / ".join(line.strip() for log in logs for line in log.strip().splitlines()[-3:])
        return {"ok": False, "note": f"exit {codes} after {wall:.0f} s: {tail[-600:]}"}
    r = json.loads(out.read_text())
    ends = r["ends"]
    seconds = ends[-1] - ends[a.warmup - 1]
    tokens = a.batch * a.per_node * a.nodes * int(data["seq_len"]) * a.steps
    return {"ok": True, "tps": tokens / seconds, "loss": statistics.fmean(r["losses"][-a.loss_steps:]),
            "wait": r["outer_wait_s"], "wall": wall}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--periods", default="2,4", help="H of the periodic arms, comma-separated")
    p.add_argument("--config", default=str(HERE / "configs" / "small.yaml"), help="the recipe config (its model)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (more than 2: joined by a bridge)")
    p.add_argument("--per-node", type=int, default=1, help="ranks per emulated node")
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--warmup", type=int, default=4, help="steps before the measured ones (a multiple of every H)")
    p.add_argument("--steps", type=int, default=16, help="measured steps (a multiple of every H)")
    p.add_argument("--loss-steps", type=int, default=4, help="the loss is the mean over this many last steps")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of the inter-node link (root)")
    p.add_argument("--no-netns", action="store_true", help="every node on loopback, no link cap")
    p.add_argument("--max-bytes", type=int, default=0, help="corpus bytes (0: the recipe's default)")
    p.add_argument("--cache-dir", default=None, help="token cache folder (lm_data's default if unset)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per arm, then every rank is killed")
    p.add_argument("--smoke", action="store_true", help="tiny settings for CI (explicit options still win)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    if argv is None:
        argv = sys.argv[1:]
    if "--smoke" in argv:
        p.set_defaults(**SMOKE, no_netns=True)
    a = p.parse_args(argv)
    if a.worker:
        worker(json.loads(a.worker), a.out)
        return {}
    a.arms = [x for x in a.arms.split(",") if x]
    a.periods = [int(h) for h in a.periods.split(",") if h]
    bad = [x for x in a.arms if x not in ARMS]
    if bad or not a.arms:
        p.error(f"--arms {','.join(a.arms)!r}: allowed are {', '.join(ARMS)}")
    if any(h < 2 for h in a.periods) or (set(a.arms) - {"sync"} and not a.periods):
        p.error(f"--periods {a.periods}: periodic arms need H >= 2")
    if a.nodes < 2:
        p.error(f"--nodes {a.nodes}: allowed is an int >= 2")
    if a.warmup < 1 or a.steps < 1 or not 1 <= a.loss_steps <= a.warmup + a.steps:
        p.error(f"--warmup {a.warmup}, --steps {a.steps}, --loss-steps {a.loss_steps}: allowed are warmup >= 1,"
                " steps >= 1, 1 <= loss-steps <= warmup + steps")
    netns = not a.no_netns and os.geteuid() == 0 and shutil.which("ip") is not None
    if not a.no_netns and not netns:
        print("bench_sync: not root (or no iproute2): every node on loopback, no link cap; tokens/s compare nothing")
    specs = arm_specs(a)
    print(cpu_line(f"{a.nodes} nodes x {a.per_node} rank(s) x {a.threads} thread(s)",
                   f"link {a.rate} (tbf)" if netns else "loopback"), flush=True)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in specs}
    with tempfile.TemporaryDirectory(prefix="bench_sync-") as tmp_name:
        tmp = Path(tmp_name)
        ns_cm = Namespaces(a.nodes) if netns else None
        ns = ns_cm.__enter__() if ns_cm else None
        try:
            if ns is not None and not ns.shape(a.rate, default_burst(a.rate)):
                print("bench_sync: tbf refused: the link is not capped")
            for rnd in range(a.rounds):
                order = specs[rnd % len(specs):] + specs[: rnd % len(specs)]
                for name, strategy in order:
                    r = run_arm(name, strategy, a, ns, tmp)
                    rows[name].append(r)
                    what = (f"{r['tps']:,.0f} tok/s, loss {r['loss']:.4f}" + (f", outer wait {r['wait']:.3f} s"
                            if r.get("wait") is not None else "") if r["ok"] else f"FAILED: {r['note']}")
                    print(f"  round {rnd + 1} {name}: {what} ({r.get('wall', 0):.0f} s)", flush=True)
        finally:
            if ns_cm is not None:
                ns_cm.__exit__(None, None, None)
    return table(rows, a)


def table(rows: dict[str, list[dict[str, Any]]], a: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name, runs in rows.items():
        ok = [r for r in runs if r["ok"]]
        if ok:
            tps = [r["tps"] for r in ok]
            summary[name] = {"tps": statistics.median(tps), "min": min(tps), "max": max(tps),
                             "loss": statistics.median(r["loss"] for r in ok)}
    base = summary.get("sync")
    print(f"\n| arm | tokens/s (min-max over {a.rounds} rounds) | vs sync | vs local_sgd, same H | loss (last"
          f" {a.loss_steps} steps) | loss vs sync |")
    print("|---|---|---|---|---|---|")
    for name in rows:
        s = summary.get(name)
        if s is None:
            print(f"| {name} | failed | | | | |")
            continue
        h = name.rsplit("-H", 1)[1] if "-H" in name else None
        local = summary.get(f"local_sgd-H{h}") if h and not name.startswith("local_sgd") else None
        vs = lambda ref: f"{s['tps'] / ref['tps']:.2f}x" if ref else "-"  # noqa: E731
        loss_vs = f"{(s['loss'] / base['loss'] - 1) * 100:+.1f}%" if base else "-"
        print(f"| {name} | {s['tps']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f}) | {vs(base)} | {vs(local)} |"
              f" {s['loss']:.4f} | {loss_vs} |")
    if base and len(summary) > 1:
        best = max(v["tps"] for v in summary.values())
        print(f"\nsync steps at most {(1 - base['tps'] / best) * 100:.0f}% communication (1 - sync / the fastest arm)")
    return summary


if __name__ == "__main__":
    main()
