"""Benchmark: allreduce of 1..64 MiB with flat vs hierarchical vs torus2d on 4 ranks (2 emulated nodes x 2).

    python recipes/bench_collectives.py                 # as root: network namespaces + veth (+ a tbf run)
    python recipes/bench_collectives.py --no-netns      # everything on loopback (no interface counters)
    python recipes/bench_collectives.py --rate 500mbit --sizes 1,8,64 --reps 5 --with-int8
    python recipes/bench_collectives.py --codec --sizes 2,8,64      # the codecs alone, in GB/s against copy_
    python recipes/bench_collectives.py --shaped-only --sizes 0.001,0.0625,1 --reps 9 --calls   # each call's latency

As root, with iproute2, each emulated node gets its own network namespace, joined to the other by a veth pair:
intra-node traffic stays on the namespace's loopback, inter-node traffic crosses the veth, and both are read
from the interface counters (``/proc/net/dev`` inside each namespace) next to what the hooks' accounting and
the cost model say. If ``tc qdisc ... tbf`` works on the veth (``netem`` is not in every kernel), the run is
repeated on a rate-limited inter-node link. The algorithms run interleaved (each repetition rotates their
order), every rank times the allreduce, and the slowest rank's time counts. The namespaces are deleted on exit.

Last, the cost model predicts 8, 16, 64 and 256 nodes of 2 and 8 ranks, with the links probed here and with
reference cluster constants.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from _bench import Namespaces, default_burst  # noqa: E402  (recipes/ is on sys.path when run as a script)
from lightning_horizon.collectives import CollectivesConfig, CostModel, GradientSync, Link
from lightning_horizon.collectives.cost_model import BucketPlanner
from lightning_horizon.collectives.layout import Piece
from lightning_horizon.collectives.accounting import CommAccounting
from lightning_horizon.collectives.chunks import FP32
from lightning_horizon.collectives.comm import Comm
from lightning_horizon.collectives.probe import probe
from lightning_horizon.topology import ProcessGroups, Topology
from lightning_horizon.state import TrainingState

WORLD, PER_NODE = 4, 2
#: --calls: the collectives the algorithms issue (gloo's ring allreduce; the pairwise exchange of all_to_all and
#: all_gather), inside the nodes, across them (every column at once) and over the world
CALLS = ("intra allreduce", "intra exchange", "inter allreduce", "inter exchange", "world allreduce")
MIB = 2**20
#: reference constants for the predictions: shared memory inside a node, 25 Gbit/s Ethernet between nodes
CLUSTER = CostModel(intra=Link(2e-6, 1 / 20e9), inter=Link(15e-6, 1 / 3.125e9))


# ---------------------------------------------------------------------- worker (one rank)


def _counters() -> dict[str, int]:
    """tx bytes per interface of this process's network namespace."""
    out = {}
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, fields = line.split(":", 1)
        out[name.strip()] = int(fields.split()[8])
    return out


def worker(rank: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    groups = ProcessGroups(Topology(world_size=WORLD, rank=rank, ranks_per_node=PER_NODE))
    chunk = {"pipeline_chunk_mb": args.chunk_mb}
    variants = {name: CollectivesConfig(name, **chunk) for name in ("flat", "hierarchical", "torus2d")}
    if args.with_int8:
        variants["hierarchical_int8"] = CollectivesConfig("hierarchical", compression="int8", **chunk)
    # One parameter per size: the error feedback keeps its residual per parameter.
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(int(mib * MIB) // 4)) for mib in args.sizes])
    syncs = {name: GradientSync(cfg, groups, params, TrainingState()) for name, cfg in variants.items()}
    links = probe(groups)
    local_zero = rank % PER_NODE == 0
    veth = os.environ.get("GLOO_SOCKET_IFNAME")
    rows = []
    for mib, param in zip(args.sizes, params):
        numel = param.numel()
        buf = torch.randn(numel)
        for name, sync in syncs.items():  # warm-up: connections, allocations
            sync.reduce(Piece.contiguous([param], buf.clone())).wait()
            sync.after_optimizer_step()
        for rep in range(args.reps):
            names = list(syncs)
            names = names[rep % len(names):] + names[: rep % len(names)]  # interleaved, rotating order
            for name in names:
                sync = syncs[name]
                x = buf.clone()
                dist.barrier()
                before = _counters() if local_zero and veth else {}
                dist.barrier()
                start = time.perf_counter()
                sync.reduce(Piece.contiguous([param], x)).wait()
                elapsed = time.perf_counter() - start
                sync.after_optimizer_step()
                dist.barrier()
                after = _counters() if local_zero and veth else {}
                measured = [0.0, 0.0]  # inter (veth), intra (lo) tx bytes of this node
                if before:
                    measured = [after[veth] - before[veth], after["lo"] - before["lo"]]
                stats = torch.tensor(
                    [elapsed, sync.accounting.last_step.inter_bytes, sync.accounting.last_step.intra_bytes, *measured],
                    dtype=torch.float64,
                )
                gathered = [torch.empty_like(stats) for _ in range(WORLD)]
                dist.all_gather(gathered, stats)
                g = torch.stack(gathered)
                rows.append({
                    "mib": mib, "algorithm": name, "rep": rep, "seconds": g[:, 0].max().item(),
                    "accounted_inter": g[:, 1].mean().item(), "accounted_intra": g[:, 2].mean().item(),
                    "measured_inter": g[:, 3].sum().item() / WORLD if veth else None,
                    "measured_intra": g[:, 4].sum().item() / WORLD if veth else None,
                })
    calls = _call_times(groups, args.sizes, args.reps) if args.calls else {}
    if rank == 0:
        out = {"rows": rows, "calls": calls,
               "links": {"intra": [links.intra.alpha, links.intra.beta], "inter": [links.inter.alpha, links.inter.beta],
                         "codec": dict(links.codec)}}
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def _call_times(groups: ProcessGroups, sizes: list[float], reps: int) -> dict[str, list[float]]:
    """``--calls``: each collective the algorithms issue, alone, every group of its kind at once (as in a step):
    ``"primitive@MiB" -> [min, median]`` seconds over ``reps`` calls, the slowest rank's. Their spread is what the
    cost model's latency cannot hold where ranks share cores (each call waits for its processes to be scheduled)."""
    topo, scratch = groups.topology, CommAccounting()
    comms = {"intra": Comm(groups.intra, groups.intra_ranks, topo, scratch),
             "inter": Comm(groups.inter, groups.inter_ranks, topo, scratch),
             "world": Comm(None, list(range(WORLD)), topo, scratch)}
    out = {}
    for mib in sizes:
        numel = max(WORLD, int(mib * MIB) // 4 // WORLD * WORLD)
        for name in CALLS:
            where, kind = name.split()
            comm, x, y = comms[where], torch.zeros(numel), torch.empty(numel)
            call = ((lambda: comm.allreduce(x)) if kind == "allreduce"
                    else (lambda: comm.all_to_all(y.view(comm.size, -1), x.view(comm.size, -1))))
            call()  # warm-up
            times = []
            for _ in range(reps):
                dist.barrier()
                times.append(_timed(call))
            t = torch.tensor([min(times), statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out[f"{name}@{mib:g}"] = t.tolist()
    return out


# ---------------------------------------------------------------------- driver


def launch(args: argparse.Namespace, ns: Namespaces | None, out: str) -> dict:
    procs = []
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    port = str(find_free_network_port())  # free now: one derived from the pid can be another run's
    try:
        for rank in range(WORLD):
            prefix, extra = ns.command(rank // PER_NODE) if ns else ([], {"MASTER_ADDR": "127.0.0.1"})
            env = {**os.environ, "MASTER_PORT": port, "OMP_NUM_THREADS": "1", **extra}
            cmd = [*prefix, sys.executable, __file__, "--worker", str(rank), "--out", out,
                   "--sizes", ",".join(map(str, args.sizes)), "--reps", str(args.reps), "--chunk-mb", str(args.chunk_mb)]
            if args.with_int8:
                cmd.append("--with-int8")
            if args.calls:
                cmd.append("--calls")
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        deadline = time.time() + args.timeout
        for p in procs:
            if p.wait(timeout=max(1.0, deadline - time.time())):
                raise RuntimeError(f"a bench rank exited with {p.returncode}")
    finally:
        for p in procs:  # reap every rank, whatever happened
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return json.loads(Path(out).read_text())


def report(title: str, result: dict, chunk_numel: int) -> CostModel:
    links = CostModel.coerce(result["links"])
    print(f"\n== {title}: probed links: {links.describe()}")
    rows = result["rows"]
    names = list(dict.fromkeys(r["algorithm"] for r in rows))
    measured = rows[0]["measured_inter"] is not None
    print("median ms per allreduce (slowest rank); time ratios flat / algorithm, measured (cost model)")
    print(f"{'MiB':>5} " + " ".join(f"{n:>18}" for n in names) + "  " + " ".join(f"{n:>18}" for n in names[1:]))
    for mib in dict.fromkeys(r["mib"] for r in rows):
        t = {n: statistics.median(r["seconds"] for r in rows if r["mib"] == mib and r["algorithm"] == n) for n in names}
        m = {n: _predict(links, n, mib, chunk_numel).time for n in names}
        ratios = [f"{t['flat'] / t[n]:.2f} ({m['flat'] / m[n]:.2f})" for n in names[1:]]
        print(f"{mib:>5g} " + " ".join(f"{t[n] * 1e3:>18.1f}" for n in names) + "  "
              + " ".join(f"{r:>18}" for r in ratios))
    print("cost model's time / measured time (1.00: exact; below 1: the model is optimistic)")
    print(f"{'MiB':>5} " + " ".join(f"{n:>18}" for n in names))
    for mib in dict.fromkeys(r["mib"] for r in rows):
        t = {n: statistics.median(r["seconds"] for r in rows if r["mib"] == mib and r["algorithm"] == n) for n in names}
        print(f"{mib:>5g} " + " ".join(f"{_predict(links, n, mib, chunk_numel).time / t[n]:>18.2f}" for n in names))
    print(f"\ninter-node MiB per rank per allreduce: accounted | model" + (" | veth counters" if measured else ""))
    for mib in dict.fromkeys(r["mib"] for r in rows):
        cells = []
        for n in names:
            r = next(r for r in rows if r["mib"] == mib and r["algorithm"] == n)
            model = _predict(links, n, mib, chunk_numel)
            cell = f"{r['accounted_inter'] / MIB:.3f} | {model.inter_bytes / MIB:.3f}"
            if measured:
                cell += f" | {r['measured_inter'] / MIB:.3f}"
            cells.append(f"{n}: {cell}")
        print(f"{mib:>5g}  " + "   ".join(cells))
    if measured:
        r = [x for x in rows if x["accounted_inter"] > 0]
        ratio = [x["measured_inter"] / x["accounted_inter"] for x in r]
        print(f"veth bytes / accounted bytes: {min(ratio):.3f} .. {max(ratio):.3f} (TCP/IP + Ethernet headers, ACKs)")
        ri = [x["measured_intra"] / x["accounted_intra"] for x in rows if x["accounted_intra"] > 0]
        print(f"loopback bytes / accounted intra-node bytes: {min(ri):.3f} .. {max(ri):.3f}")
    if result["calls"]:
        print("\nms per collective call, alone (slowest rank; min / median of the reps): a call's latency")
        print(f"{'MiB':>7} " + " ".join(f"{n:>17}" for n in CALLS))
        for mib in dict.fromkeys(k.split("@")[1] for k in result["calls"]):
            cells = (result["calls"][f"{n}@{mib}"] for n in CALLS)
            print(f"{mib:>7} " + " ".join(f"{lo * 1e3:>7.2f} / {mid * 1e3:<7.2f}" for lo, mid in cells))
    return links


def _predict(model: CostModel, variant: str, mib: float, chunk_numel: int):
    """The cost model's prediction for a bench variant ("flat", "hierarchical_int8", ...) on 2 x 2."""
    algorithm, compression = (variant.split("_") + [None])[:2]
    return model.predict(algorithm, int(mib * MIB) // 4, WORLD // PER_NODE, PER_NODE, compression,
                         chunk_numel=chunk_numel)


def predictions(title: str, model: CostModel, mib: float = 8) -> None:
    numel, chunk = int(mib * MIB) // 4, CollectivesConfig().chunk_numel
    print(f"\n== cost model, {mib:g} MiB bucket, {title}: {model.describe()}")
    print(f"{'nodes':>6} {'x L':>4} {'flat ms':>9} {'hier ms':>9} {'piped ms':>9} {'+int8 ms':>9} {'flat/best':>9}"
          f"  {'inter MiB/rank flat | hier (flat busiest)':>41}  auto")
    for nodes in (8, 16, 64, 256):
        for per_node in (2, 8):
            f = model.predict("flat", numel, nodes, per_node)
            h = model.predict("hierarchical", numel, nodes, per_node, chunk_numel=numel)
            piped = model.predict("hierarchical", numel, nodes, per_node, chunk_numel=chunk)
            q = min(model.predict("hierarchical", numel, nodes, per_node, compression="int8", chunk_numel=c).time
                    for c in (numel, chunk))
            algorithm, c, _ = BucketPlanner(CollectivesConfig("auto"), nodes, per_node, per_node, model).plan_for(numel)
            auto = algorithm + (f" in {c * 4 / MIB:g} MiB chunks" if algorithm != "flat" and c < numel else "")
            inter = f"{f.inter_bytes / MIB:.3f} | {h.inter_bytes / MIB:.3f} ({f.inter_bytes_max / MIB:.2f})"
            print(f"{nodes:>6} {per_node:>4} {f.time * 1e3:>9.2f} {h.time * 1e3:>9.2f} {piped.time * 1e3:>9.2f}"
                  f" {q * 1e3:>9.2f} {f.time / min(h.time, piped.time):>9.2f}  {inter:>41}  {auto}")


def codec_table(sizes: list[float], reps: int) -> None:
    """The codecs alone, in this process on all its threads: GB/s of fp32 encoded and decoded, against a plain
    ``copy_`` of the same tensor (the memory bandwidth a single pass over it can reach), and the whole compressed
    allreduce of one rank (what the probe times for the cost model), per size."""
    from lightning_horizon.collectives.compression import Codec
    from lightning_horizon.collectives.probe import codec_seconds

    def best(fn) -> float:
        fn()
        return min(_timed(fn) for _ in range(reps))

    threads = torch.get_num_threads()
    kernel = "one C kernel, 1 thread" if Codec("int8").native else f"torch ops, {threads} threads"
    print(f"\n== codecs alone: GB/s of fp32, best of {reps}; int8 runs as {kernel}; encode + error is what a"
          " compressed allreduce does to its input")
    print(f"  MiB   copy_ {threads} / 1 thr   int8 encode / encode + error / decode / allreduce alone   (x copy_ 1 thr)"
          "   bf16 encode / decode / allreduce alone")
    for mib in sizes:
        numel = int(mib * MIB) // 4
        x = torch.randn(1, numel)
        gbs = lambda seconds: 4 * numel / seconds / 1e9  # noqa: E731
        y, error = torch.empty_like(x), torch.empty_like(x)
        copy = gbs(best(lambda: y.copy_(x)))
        torch.set_num_threads(1)
        copy1 = gbs(best(lambda: y.copy_(x)))
        torch.set_num_threads(threads)
        row = [f"{copy:7.1f} / {copy1:5.1f}"]
        for name in ("int8", "bf16"):
            codec = Codec(name)
            packed = codec.encode(x)
            encode, decode = gbs(best(lambda: codec.encode(x))), gbs(best(lambda: codec.decode(packed, numel)))
            alone = FP32 / codec_seconds(name, numel=numel, repeats=reps) / 1e9  # per encode or decode, as the probe
            if name == "int8":
                fed = gbs(best(lambda: codec.encode(x, error)))
                row.append(f"{encode:6.2f} / {fed:6.2f} / {decode:6.2f} / {alone:6.2f}   ({fed / copy1:.2f})")
            else:
                row.append(f"{encode:6.2f} / {decode:6.2f} / {alone:6.2f}")
        print(f"  {mib:>3g}  " + "   ".join(row))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=lambda s: [float(v) for v in s.split(",")], default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rate", default="1gbit", help="tbf rate of the inter-node link for the shaped run")
    p.add_argument("--burst", default=None,
                   help="tbf bucket: bytes that leave at the veth's own speed before the rate applies (default: 2 ms"
                        " at the rate, at least 64kb; a real link has none, and a large one lets a small allreduce"
                        " through at the veth's speed)")
    p.add_argument("--no-netns", action="store_true", help="run on loopback only")
    p.add_argument("--no-shape", action="store_true", help="skip the rate-limited run")
    p.add_argument("--shaped-only", action="store_true", help="skip the unshaped run (root, network namespaces)")
    p.add_argument("--with-int8", action="store_true", help="add hierarchical with int8 compression")
    p.add_argument("--chunk-mb", type=float, default=CollectivesConfig().pipeline_chunk_mb,
                   help="pipeline chunk of the two-level algorithms (MiB)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--calls", action="store_true", help="also time each collective call the algorithms issue,"
                   " alone, at every size (min and median: how much a call's latency varies)")
    p.add_argument("--codec", action="store_true", help="only the codecs alone, against copy_ (no ranks, no root)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        worker(args.worker, args)
        return
    if args.codec:
        codec_table(args.sizes, args.reps)
        return
    netns = not args.no_netns and os.geteuid() == 0 and shutil.which("ip") is not None
    if not args.no_netns and not netns:
        print("not root or no iproute2: all ranks on loopback, no interface counters")
    tmp = tempfile.mkdtemp(prefix="bench_collectives_")
    chunk = CollectivesConfig(pipeline_chunk_mb=args.chunk_mb).chunk_numel
    probed = None
    if netns:
        with Namespaces() as ns:
            if not args.shaped_only:
                probed = report("2 namespaces joined by veth, unshaped", launch(args, ns, f"{tmp}/plain.json"),
                                chunk)
            burst = args.burst or default_burst(args.rate)
            if not args.no_shape and ns.shape(args.rate, burst):
                probed = report(f"veth rate-limited by tbf to {args.rate} (burst {burst})",
                                launch(args, ns, f"{tmp}/tbf.json"), chunk)
    else:
        probed = report("loopback", launch(args, None, f"{tmp}/plain.json"), chunk)
    predictions("links probed here", probed)
    predictions("reference cluster (25 Gbit/s Ethernet)", CLUSTER)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
