"""Benchmark: HorizonStrategy(state="replicated") against state="node_sharded" on one node, 2 and 4 ranks, and
against what a user would pick instead, torch's FSDP2.

The arms (``--arms``): replicated, node_sharded (one shared copy of the weights per node), node_sharded-copies
(``node_weights="copies"``: a copy per rank, the owners' updates broadcast inside the node after each step), and
fsdp2 (``fully_shard`` on every block and the model, under Lightning's ``ModelParallelStrategy`` with
``data_parallel_size`` = ranks; with ``--precision bf16-true-fp32`` its bf16 ``MixedPrecisionPolicy``).

    python recipes/bench_state.py                                           # 2 and 4 ranks, fp32, 2 rounds
    python recipes/bench_state.py --ranks 2,4 --precision bf16-true-fp32 --fit-memory 2GiB
    python recipes/bench_state.py --arms replicated,node_sharded,fsdp2 --precision bf16-true-fp32
    python recipes/bench_state.py --smoke --arms replicated,node_sharded,fsdp2 --fit-memory 4GiB  # CI: 3 runs

Each arm (state x ranks) trains the recipes' GPTPretrain (recipes/pretrain_gpt.py: AdamW, same seed) on the byte
corpus of recipes/lm_data.py for ``--warmup`` + ``--steps`` steps, in a fresh process group (tune.run_worker: its
own session, killed on timeout); Lightning's launcher starts the other ranks. Every round runs every arm once, in a
rotated order, so a noisy neighbour hits both states alike. ``--batch`` is per rank; every rank runs
``HorizonStrategy(state=..., threads_per_rank=max(1, cores // ranks))`` (more ranks than cores: oversubscribed,
1 thread each, which the output says). ``--precision 32-true`` is Lightning's fp32; ``bf16-true-fp32`` is
``HorizonPrecision("bf16-true", master="fp32")`` (bf16 weights and gradients, fp32 masters).

Per arm:

- peak memory per node. node_sharded maps one copy of the weights per node from /dev/shm into every rank, so a rank's
  RSS counts those shared pages again and the sum of RSS is no measure of the node. As root with a writable memory
  cgroup, each run gets a fresh child of this process's own memory cgroup (v1: the peak is
  ``memory.max_usage_in_bytes``; v2: ``memory.peak``); the worker moves itself into it first thing, before it imports
  torch, so the ranks Lightning's launcher starts are born in it, and the folder is removed after the run. The
  cgroup also charges the shared-memory file (once) and any page cache the run reads first. Otherwise: every rank
  reads its PSS (``/proc/self/smaps_rollup``, shared pages divided among their mappers) at the end of each step,
  and the node's figure is the sum of the ranks' maxima (blind to peaks inside a step). The PSS sum is shown in
  both cases, and the table says which method gives the headline figure.
- training state per node: the bytes of the live tensors that are the training state (weights, masters or
  compensations, gradients, optimizer state; ``lightning_horizon.memory.held_bytes``) at each step's end, gradients
  still there, the largest per rank, summed over the ranks (one shared copy of the weights counts 1/L on each):
  what the issue's target is about, without activations, allocator slack or the interpreter.
- training added per node: the same PSS maxima minus each rank's PSS before it built the model, summed: the model,
  its training state, the activations and what the allocator keeps, without the interpreter, torch and Lightning
  (~300 MiB a rank), which every state pays alike.
- peak RSS per rank (``VmHWM``, the largest rank), tokens/s (tune.StepTimer / tune.measure: the median step after
  the warm-up; the median over rounds, min-max shown), and the bytes all ranks together sent in the last step
  (``trainer.strategy.comm_metrics()`` read after that step: replicated ``comm/intra_bytes`` + ``comm/inter_bytes``
  of its GradientSync, node_sharded ``bytes_intra`` + ``bytes_inter``; fsdp2 has no such count: its bytes are
  computed from its collectives' sizes). Also shown: the share of the machine other processes took meanwhile
  (StepTimer's "foreign"; above a few percent, tokens/s measured the neighbours too) and rank 0's loss at the last
  step (same seed, data and global batch: the two states should agree).

``--fit-memory SIZE`` then searches, for each state (and FSDP2 when it is an arm) at the largest ``--ranks``, the
widest GPT whose measured peak memory per node stays within SIZE: a ladder of ``n_embd`` = 64, 128, ...
``--fit-max-embd`` at fixed ``--n-layer`` and ``--n-head`` (which must divide 64), binary-searched (a run that fails
counts as "does not fit"), each candidate a fresh process group training ``--fit-steps`` steps (the first step
allocates the optimizer state); it prints the models' parameters and the ratios. A candidate the table already ran
(that state and rank count at ``--n-embd``, with ``--warmup`` 1 and ``--steps`` = ``--fit-steps`` - 1, as
``--smoke`` has it) takes the table's peak (the largest over its rounds) instead of running again. The criterion is
the measured peak only: no cgroup limit is set, so an over-budget candidate runs to its end (the ladder's top bounds
what the search can allocate).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # _bench.py, gpt.py, lm_data.py, pretrain_gpt.py

from _bench import join_cgroup  # noqa: E402

join_cgroup()  # a worker (or a rank its launcher started) joins its run's cgroup before allocating

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from typing import Any, Optional  # noqa: E402

from _bench import cpu_line, parse_common, parse_size, probe_cgroup, run_cgroup  # noqa: E402
STATES = ("replicated", "node_sharded")  # the --fit-memory search compares these two
#: the arms of the comparison: HorizonStrategy keywords (node_sharded shares one copy of the weights per node;
#: "node_sharded-copies" keeps a copy per rank that the owners update by broadcast)
ARMS = {"replicated": {"state": "replicated"}, "node_sharded": {"state": "node_sharded"},
        "node_sharded-copies": {"state": "node_sharded", "node_weights": "copies"}}
#: what a user would pick instead, in the same table: torch's FSDP2 (``fully_shard`` on every block, then on the
#: model) under Lightning's ``ModelParallelStrategy(data_parallel_size=ranks)``; with ``--precision bf16-true-fp32``
#: its ``MixedPrecisionPolicy`` computes in bf16 on the fp32 sharded parameters and reduces in fp32 (the counterpart
#: of bf16-true with fp32 masters)
FOREIGN = ("fsdp2",)
PRECISIONS = ("32-true", "bf16-true-fp32")
MIB = 2**20
SMOKE = dict(n_layer=1, n_head=2, n_embd=64, seq=32, batch=2, warmup=1, steps=1, rounds=1, ranks="2",
             fit_max_embd=64, fit_steps=2, max_bytes=2**20)


# ---------------------------------------------------------------------------------------------- worker side


def worker(spec: dict[str, Any], out: str) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_horizon import HorizonStrategy
    from lightning_horizon.memory import current_pss, held_bytes
    from lightning_horizon.precision import HorizonPrecision
    from lightning_horizon.layout import StepTimer
    from lm_data import ByteCorpusDataModule
    from pretrain_gpt import GPTPretrain

    class FullyShardedGPT(GPTPretrain):
        """The same GPT, fully sharded by FSDP2 over the strategy's data-parallel mesh."""

        def configure_model(self) -> None:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                      if spec["precision"] == "bf16-true-fp32" else MixedPrecisionPolicy())
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=policy)
            fully_shard(self.model, mesh=mesh, mp_policy=policy)

    def fsdp2_bytes(module: Any, ranks: int) -> dict[str, int]:
        """What FSDP2 sends per step and rank, from its collectives' sizes: every parameter all-gathered for the
        forward and again for the backward (in the compute dtype), every gradient reduce-scattered in fp32, each
        moving (R-1)/R of its bytes per rank on a ring. Counted by no hook of ours: computed."""
        numel = sum(p.numel() for p in module.parameters())  # DTensors: the whole parameter's element count
        width = 2 if spec["precision"] == "bf16-true-fp32" else 4
        return {"computed_intra_bytes": int((ranks - 1) / ranks * numel * (2 * width + 4))}

    class Probe(Callback):
        """Every rank: its largest PSS at a step end, the last step's communication and loss, to ``out.rankN.json``."""

        def __init__(self, base: int) -> None:
            self.base, self.pss, self.state, self.comm, self.loss = base, 0, 0, {}, float("nan")

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *_: Any) -> None:
            comm = getattr(trainer.strategy, "comm_metrics", None)
            self.pss = max(self.pss, current_pss())
            self.comm = comm() if comm else fsdp2_bytes(pl_module, trainer.world_size)
            self.loss = float(outputs["loss"])
            # the training state in live tensors, gradients still there; one shared copy of the weights counts 1/L
            held = held_bytes(pl_module, trainer.optimizers, trainer.precision_plugin)
            node = getattr(trainer.strategy, "node_state", None)
            shared = node is not None and node.weights_mode == "shared"
            weights = held["weights"] // trainer.strategy.topology.ranks_per_node if shared else held["weights"]
            self.state = max(self.state, held["total"] - held["weights"] + weights)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.path = Path(f"{out}.rank{trainer.global_rank}.json")
            self.path.write_text(json.dumps({"pss": self.pss, "base": self.base, "state": self.state,
                                             "comm": self.comm, "loss": self.loss}))

    L.seed_everything(1337, verbose=False)
    if spec["state"] in FOREIGN:  # FSDP2 computes in bf16 through its own policy (FullyShardedGPT)
        from lightning.pytorch.strategies import ModelParallelStrategy

        torch.set_num_threads(spec["threads"])  # as HorizonStrategy's threads_per_rank does for our arms
        strategy, precision, model_class = (ModelParallelStrategy(data_parallel_size=spec["ranks"],
                                                                  tensor_parallel_size=1),
                                            {"precision": "32-true"}, FullyShardedGPT)
    else:
        strategy = HorizonStrategy(**ARMS[spec["state"]], threads_per_rank=spec["threads"])
        precision = ({"precision": "32-true"} if spec["precision"] == "32-true"
                     else {"plugins": [HorizonPrecision("bf16-true", master="fp32")]})
        model_class = GPTPretrain
    probe = Probe(current_pss())  # before this rank builds the model: what training adds is measured from here
    trainer = L.Trainer(
        accelerator="cpu", devices=spec["ranks"], max_steps=spec["steps"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=strategy, callbacks=[StepTimer(), probe], **precision)
    trainer.fit(model_class(**spec["model"]), ByteCorpusDataModule(**spec["data"]))
    report = json.loads(probe.path.read_text())  # what comm_metrics() says once fit is over, for the record
    after = getattr(trainer.strategy, "comm_metrics", dict)()
    probe.path.write_text(json.dumps({**report, "comm_after_fit": after}))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------- driver side


def run_arm(state: str, ranks: int, a: argparse.Namespace, n_embd: int, warmup: int, steps: int,
            tmp: Path) -> dict[str, Any]:
    """One arm in a fresh process group: its figures, or ``{"ok": False, "note": ...}``."""
    from lightning_horizon.layout import Layout
    from lightning_horizon.layout.timer import OUT_ENV, WARMUP_ENV
    from lightning_horizon.layout.tuner import clean_env, measure, run_worker

    threads = max(1, len(os.sched_getaffinity(0)) // ranks)
    spec = {"state": state, "ranks": ranks, "threads": threads, "precision": a.precision, "steps": warmup + steps,
            "model": {"n_layer": a.n_layer, "n_head": a.n_head, "n_embd": n_embd, "block_size": a.seq},
            "data": {"seq_len": a.seq, "batch_size": a.batch, "max_bytes": a.max_bytes, "cache_dir": a.cache_dir}}
    out = tmp / uuid.uuid4().hex[:12]
    env = clean_env()  # a clean shell, as tune's workers
    env.update({OUT_ENV: f"{out}.json", WARMUP_ENV: str(warmup)})
    with run_cgroup(env, "bench_state") as cg:
        t0 = time.perf_counter()
        rc, log = run_worker([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec),
                              "--out", str(out)], env, a.timeout)
        cgroup_peak = cg.peak() if cg else None
    wall = time.perf_counter() - t0
    rank_files = sorted(tmp.glob(f"{out.name}.rank*.json"))
    if rc != 0 or not Path(f"{out}.json").exists() or len(rank_files) != ranks:
        tail = " / ".join(line.strip() for line in log.strip().splitlines()[-4:]) or "no output"
        return {"ok": False, "note": f"exit {rc} after {wall:.0f} s: {tail[-400:]}", "log": log}
    res = measure(json.loads(Path(f"{out}.json").read_text()), Layout(ranks, threads), warmup)
    per_rank = [json.loads(p.read_text()) for p in rank_files]
    pss_sum = sum(r["pss"] for r in per_rank)
    added = sum(r["pss"] - r["base"] for r in per_rank)  # the model, its training state and activations
    state = sum(r["state"] for r in per_rank)
    sent = sum(sum(v for k, v in r["comm"].items() if k.endswith(("intra_bytes", "inter_bytes", "bytes_intra",
                                                                      "bytes_inter"))) for r in per_rank)
    return {"ok": res.status == "ok", "note": res.note, "tps": res.throughput, "rss": max(res.peak_rss),
            "pss_sum": pss_sum, "added": added, "state_bytes": state,
            "node": cgroup_peak if cgroup_peak is not None else pss_sum, "sent": sent,
            "foreign": res.foreign, "comm_keys": sorted(per_rank[0]["comm"]), "wall": wall, "threads": threads,
            "after_fit": per_rank[0]["comm_after_fit"], "loss": per_rank[0]["loss"]}


def parameters(a: argparse.Namespace, n_embd: int) -> int:
    import torch

    from pretrain_gpt import GPTPretrain

    with torch.device("meta"):
        module = GPTPretrain(n_layer=a.n_layer, n_head=a.n_head, n_embd=n_embd, block_size=a.seq)
    return sum(p.numel() for p in module.parameters())


def fit_search(state: str, ranks: int, a: argparse.Namespace, tmp: Path, table: dict[tuple[int, str], dict[str, Any]]
               ) -> Optional[int]:
    """The widest ``n_embd`` of the ladder whose peak memory per node is within ``a.fit_memory``, or None.
    ``table``: the comparison's rows by (ranks, arm); a candidate one of them ran already is not run again."""
    ladder = list(range(64, a.fit_max_embd + 1, 64))
    lo, hi = -1, len(ladder)  # ladder[lo] fits (or lo = -1), ladder[hi] does not (or hi = len)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        same = (ladder[mid], 1, a.fit_steps - 1) == (a.n_embd, a.warmup, a.steps) and (ranks, state) in table
        r = table[(ranks, state)] if same else run_arm(state, ranks, a, ladder[mid], 1, a.fit_steps - 1, tmp)
        fits = r["ok"] and r["node"] <= a.fit_memory
        took = "the table's run" if same else f"{r['wall']:.0f} s"
        what = f"peak {r['node'] / MIB:,.0f} MiB per node ({took})" if r["ok"] else f"failed ({r['note']})"
        print(f"  fit {state} @ {ranks} ranks: n_embd {ladder[mid]} ({parameters(a, ladder[mid]) / 1e6:.2f}M"
              f" params): {what} -> {'fits' if fits else 'does not fit'}", flush=True)
        lo, hi = (mid, hi) if fits else (lo, mid)
    return ladder[lo] if lo >= 0 else None


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="rank counts on this node, comma-separated")
    p.add_argument("--precision", default="32-true", choices=PRECISIONS)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join((*ARMS, *FOREIGN))}")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=8, help="must divide 64 (the --fit-memory ladder's step)")
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (and the model's block size)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--warmup", type=int, default=2, help="steps before measuring")
    p.add_argument("--steps", type=int, default=3, help="measured steps per arm and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fit-memory", type=parse_size, default=None, help="e.g. 1.5GiB: search the widest GPT that fits")
    p.add_argument("--fit-max-embd", type=int, default=1024, help="top of the n_embd ladder (64, 128, ...)")
    p.add_argument("--fit-steps", type=int, default=2, help="steps per --fit-memory candidate (>= 2)")
    a = parse_common(p, argv, SMOKE, worker)
    if a is None:  # this process was a worker
        return {}
    ranks = sorted({int(r) for r in a.ranks.split(",") if r.strip()})
    if not ranks or min(ranks) < 2 or a.warmup < 1 or a.steps < 1 or a.rounds < 1 or a.fit_steps < 2 \
            or 64 % a.n_head or a.n_embd % a.n_head:
        p.error("need --ranks >= 2, --warmup/--steps/--rounds >= 1, --fit-steps >= 2, --n-head dividing 64 and"
                " --n-embd")
    unknown = [x for x in a.arms.split(",") if x not in (*ARMS, *FOREIGN)]
    if unknown:
        p.error(f"--arms={a.arms!r}: {', '.join(unknown)} unknown; allowed are {', '.join((*ARMS, *FOREIGN))}")
    from lm_data import ByteCorpusDataModule

    cores = len(os.sched_getaffinity(0))
    cg = probe_cgroup("bench_state")
    method = (f"cgroup {cg.method} (a fresh child cgroup per run)" if cg
              else "sum over ranks of each rank's peak PSS at step ends")
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"bench_state: GPT {a.n_layer} layers x {a.n_embd} ({parameters(a, a.n_embd) / 1e6:.2f}M params),"
          f" {a.n_head} heads | {a.batch} x {a.seq} tokens per rank | {a.precision} | AdamW | ranks"
          f" {','.join(map(str, ranks))} | {a.warmup} warm-up + {a.steps} measured steps | {a.rounds} round(s) |"
          f" {started}", flush=True)
    print(cpu_line(f"/proc/cpuinfo processors: {Path('/proc/cpuinfo').read_text().count('processor')}"), flush=True)
    print(f"peak memory per node: {method}", flush=True)
    for r in ranks:
        if r > cores:
            print(f"note: {r} ranks on {cores} cores: oversubscribed (1 thread per rank); its tokens/s compares the"
                  " two states, it is no scaling figure", flush=True)
    ByteCorpusDataModule(max_bytes=a.max_bytes, cache_dir=a.cache_dir).prepare_data()  # the token cache, once
    arms = [(r, s) for r in ranks for s in a.arms.split(",")]
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="bench_state_") as tmp:
        for rnd in range(a.rounds):
            for r, s in arms[rnd % len(arms):] + arms[:rnd % len(arms)]:  # rotated: no arm always first
                res = run_arm(s, r, a, a.n_embd, a.warmup, a.steps, Path(tmp))
                if not res["ok"]:
                    raise RuntimeError(f"{s} @ {r} ranks failed: {res['note']}\n{res.get('log', '')[-3000:]}")
                runs[(r, s)].append(res)
                print(f"  round {rnd + 1}: {r} ranks {s:<12} {res['tps']:>9,.0f} tok/s  node peak"
                      f" {res['node'] / MIB:,.0f} MiB  PSS sum {res['pss_sum'] / MIB:,.0f} MiB (training added"
                      f" {res['added'] / MIB:,.0f})  max rank RSS"
                      f" {res['rss'] / MIB:,.0f} MiB  sent {res['sent'] / MIB:,.2f} MiB/step  others' load"
                      f" {100 * res['foreign']:.0f}%  ({res['wall']:.0f} s)", flush=True)
        rows = []
        for (r, s), rs in runs.items():
            tps = [x["tps"] for x in rs]
            rows.append({**rs[-1], "ranks": r, "state": s, "tps": statistics.median(tps), "min": min(tps),
                         "max": max(tps),
                         **{k: max(x[k] for x in rs)
                            for k in ("node", "pss_sum", "added", "state_bytes", "rss", "foreign")}})
        header = ("| ranks x threads | arm | training state per node MiB | peak memory per node MiB | PSS sum MiB |"
                  " training added per node MiB |"
                  " peak RSS per rank (max) MiB | tokens/s (min-max) | others' load | sent per step, all ranks MiB |"
                  " last loss, rank 0 |")
        print("\n" + header + "\n|" + "|".join("---" for _ in header.split("|")[1:-1]) + "|")
        for row in rows:
            print(f"| {row['ranks']} x {row['threads']} | {row['state']} | {row['state_bytes'] / MIB:,.0f} |"
                  f" {row['node'] / MIB:,.0f} |"
                  f" {row['pss_sum'] / MIB:,.0f} | {row['added'] / MIB:,.0f} | {row['rss'] / MIB:,.0f} |"
                  f" {row['tps']:,.0f} ({row['min']:,.0f}-"
                  f"{row['max']:,.0f}) | {100 * row['foreign']:.0f}% | {row['sent'] / MIB:,.2f} | {row['loss']:.4f} |")
            base = next((x for x in rows if x["ranks"] == row["ranks"] and x["state"] == "replicated"), None)
            if row["state"] != "replicated" and base is not None:
                q = {k: f"{row[k] / base[k]:.2f}x" if base[k] else "-"
                     for k in ("state_bytes", "node", "pss_sum", "added", "rss", "tps", "sent")}
                print(f"| {row['ranks']} | {row['state']} / replicated | {q['state_bytes']} | {q['node']} |"
                      f" {q['pss_sum']} | {q['added']} |"
                      f" {q['rss']} |"
                      f" {q['tps']} | | {q['sent']} | |")
        for r in ranks:  # our sharded state against FSDP2's, where both ran
            ours, theirs = (next((x for x in rows if x["ranks"] == r and x["state"] == s), None)
                            for s in ("node_sharded", "fsdp2"))
            if ours and theirs:
                print(f"{r} ranks, node_sharded / fsdp2: training state per node"
                      f" {ours['state_bytes'] / theirs['state_bytes']:.2f}x, peak memory per node"
                      f" {ours['node'] / theirs['node']:.2f}x, tokens/s {ours['tps'] / theirs['tps']:.2f}x, last loss"
                      f" {ours['loss']:.4f} vs {theirs['loss']:.4f}")
        for x in rows[:2]:
            print(f"{x['state']}: bytes per step = the sum over ranks of comm_metrics()'s"
                  f" {', '.join(k for k in x['comm_keys'] if 'bytes' in k) or 'nothing'}; comm_metrics() after fit:"
                  f" {', '.join(x['after_fit']) or 'empty'}")
        if any(x["state"] in FOREIGN for x in rows):
            print("fsdp2: bytes per step computed from its collectives' sizes (two all-gathers of the parameters in"
                  " the compute dtype, a reduce-scatter of fp32 gradients, (R-1)/R of each per rank), not counted")
        fit = {}
        if a.fit_memory:
            print(f"\n--fit-memory {a.fit_memory / MIB:,.0f} MiB per node, {max(ranks)} ranks, n_embd ladder 64.."
                  f"{a.fit_max_embd} step 64 ({a.n_layer} layers, {a.n_head} heads), {a.fit_steps} steps each:",
                  flush=True)
            searched = [*STATES, *(x for x in FOREIGN if x in a.arms.split(","))]
            for s in searched:
                best = fit_search(s, max(ranks), a, Path(tmp), {(x["ranks"], x["state"]): x for x in rows})
                fit[s] = {"n_embd": best, "params": parameters(a, best) if best else 0}
            for s in searched:
                what = (f"n_embd {fit[s]['n_embd']}, {fit[s]['params'] / 1e6:.2f}M params" if fit[s]["n_embd"]
                        else "none of the ladder fits")
                print(f"  largest {s}: {what}")
            rep, sh = fit["replicated"]["params"], fit["node_sharded"]["params"]
            print(f"  ratio node_sharded / replicated (parameters that fit): {f'{sh / rep:.2f}x' if rep else '-'}")
            if "fsdp2" in fit:
                other = fit["fsdp2"]["params"]
                print(f"  ratio node_sharded / fsdp2 (parameters that fit): {f'{sh / other:.2f}x' if other else '-'}")
    finished = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"{started} .. {finished}")
    result = {"method": method, "rows": rows, "fit": fit, "started": started, "finished": finished,
              "args": {k: v for k, v in vars(a).items() if k not in ("worker", "out")}}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
