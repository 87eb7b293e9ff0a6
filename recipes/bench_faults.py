"""Benchmark: goodput of the recipe GPT under faults, on 2 emulated nodes restarted by torchrun.

    python recipes/bench_faults.py                              # as root: 10 minutes, a fault every 60 s, then the
                                                                # same run without faults
    python recipes/bench_faults.py --minutes 3 --baseline-minutes 2 --fault-every 30 --faults kill
    python recipes/bench_faults.py --restart-tries 10           # 10 tries of a SIGKILLed rank restarted by torchrun
    python recipes/bench_faults.py --smoke                      # CI: tiny GPT, seconds

Each emulated node is a network namespace (recipes/_bench.py's Namespaces, as root; ``--no-netns`` or without root:
both on loopback) running one torchrun agent (``--nnodes 2 --node-rank K --nproc-per-node 1 --max-restarts 1000``,
static rendezvous at node 0's address). Each rank trains GPTPretrain (recipes/pretrain_gpt.py; ``--config``'s model,
the byte corpus) with HorizonStrategy (``--heartbeat`` seconds), ModelCheckpoint(save_last=True,
every_n_train_steps=``--every``) written in the background (AtomicCheckpointIO(background=True)),
PreemptionCheckpoint, and ``ckpt_path="last"``: every restart resumes from the last complete checkpoint. Every
``--fault-every`` seconds the driver sends the next fault of ``--faults`` (in turn) to the next rank (in turn):
``kill`` (SIGKILL: torchrun sees the rank die and restarts both nodes' groups), ``stop`` (SIGSTOP: the heartbeat
names it, kills it, and ends the job with exit 75: torchrun restarts it; the emulated nodes share one host, so the
peer can kill the stopped process, which on separate hosts its own node's launcher must do).

Each run lasts its minutes from its first step's end (the start-up before it is the same in both runs and not
measured; ``--timeout`` bounds it). Figures: goodput, the tokens/s of the steps that count (the last step reached at
the end: a step lost to a fault and trained again counts once) over the run's minutes, against the same run without faults
(``--baseline-minutes``, default the same minutes); per fault: the steps lost (trained after the last checkpoint and
trained again) and the seconds from the fault to the next step that moves the run beyond where it was (the
restart, the resume and the steps trained again), and to the first step after the restart.

``--restart-tries N``: N times, a 2-rank torchrun job (tests/scripts/recover_fit.py: a tiny MLP, 30 steps) whose rank
1 is SIGKILLed mid-epoch, restarted once by torchrun: how many recovered by themselves and ended torch.equal to the
uninterrupted run; ``--control`` also runs the N tries with the store used as before each attempt had its own keys.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from _bench import Namespaces, cpu_line  # noqa: E402

SMOKE = {"config": str(HERE / "configs" / "tiny.yaml"), "minutes": 0.5, "baseline_minutes": 0.2,
         "fault_every": 8.0, "faults": "kill", "every": 5, "heartbeat": 5.0, "max_bytes": 2**20}


# ---------------------------------------------------------------------- the rank (under torchrun)


def worker(spec: dict[str, Any]) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lm_data import ByteCorpusDataModule
    from pretrain_gpt import GPTPretrain

    from lightning_horizon import AtomicCheckpointIO, HorizonStrategy, PreemptionCheckpoint

    out = Path(spec["out"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    torch.set_num_threads(spec["threads"])

    class Steps(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.log, self.targeted = open(out / f"steps.rank{rank}.jsonl", "a", buffering=1), False

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.log.write(json.dumps({"attempt": attempt, "step": trainer.global_step, "t": time.time()}) + "\n")
            if not self.targeted:  # the driver's target once this attempt has trained a step: a fault never hits
                # a restart that has not recovered yet, so each fault's recovery is measured
                (out / f"pid.rank{rank}").write_text(str(os.getpid()))
                self.targeted = True

    L.seed_everything(1337, verbose=False)
    model = GPTPretrain(**spec["model"])
    data = ByteCorpusDataModule(**spec["data"])
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", save_last=True, every_n_train_steps=spec["every"], save_top_k=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=2,
        strategy=HorizonStrategy(heartbeat_timeout=spec["heartbeat"], timeout=120, threads_per_rank=spec["threads"],
                                 checkpoint_io=AtomicCheckpointIO(background=True)),
        callbacks=[Steps(), PreemptionCheckpoint(), ckpt], max_steps=10**6, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        default_root_dir=out)
    trainer.fit(model, data, ckpt_path="last")


# ---------------------------------------------------------------------- the driver


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def children(parents: set[int]) -> list[int]:
    """Every descendant of ``parents`` (read from /proc: the ranks of a torchrun agent, in sessions of their own)."""
    ppid = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], set(parents)
    while frontier:
        frontier = {pid for pid, parent in ppid.items() if parent in frontier}
        found.extend(frontier)
    return found


def run_job(a: argparse.Namespace, minutes: float, faults: bool, ns: Optional[Namespaces], work: Path) -> dict:
    """One job for ``minutes``: two torchrun agents (one per emulated node), the faults sent; every process killed at
    the end. Returns the steps each rank logged and the faults sent."""
    import yaml

    cfg = yaml.safe_load(Path(a.config).read_text())
    data = {**cfg.get("data", {}), "cache_dir": a.cache_dir}
    if a.batch:
        data["batch_size"] = a.batch
    if a.max_bytes:
        data["max_bytes"] = a.max_bytes
    work.mkdir(parents=True)
    spec = {"out": str(work), "model": cfg.get("model", {}), "data": data, "every": a.every,
            "heartbeat": a.heartbeat, "threads": a.threads}
    port = str(_free_port())
    procs = []
    for node in range(2):
        prefix, extra = ns.command(node) if ns else ([], {"MASTER_ADDR": "127.0.0.1"})
        cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--max-restarts", "1000", "--master-addr", extra["MASTER_ADDR"],
               "--master-port", port, "--monitor-interval", "0.5", str(Path(__file__).resolve()), "--worker",
               json.dumps(spec)]
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONPATH": str(REPO), **extra}
        log = open(work / f"node{node}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    launched = time.time()
    start = None  # the first step's end: the run's minutes count from there (start-up is not measured)
    sent = []
    kinds = [k for k in a.faults.split(",") if k]
    log0 = work / "steps.rank0.jsonl"
    try:
        next_fault = float("inf")
        while time.time() < (start + 60 * minutes if start else launched + a.timeout):
            time.sleep(0.2)
            if any(p.poll() is not None for p in procs):
                break  # an agent ended: out of restarts, or a failure it does not restart
            if start is None and log0.exists() and log0.stat().st_size > 0:
                start = json.loads(log0.read_text().splitlines()[0])["t"]
                next_fault = start + a.fault_every
            if faults and time.time() >= next_fault:
                rank, kind = len(sent) % 2, kinds[len(sent) % len(kinds)]
                pid_file = work / f"pid.rank{rank}"
                if not pid_file.exists():
                    continue  # its attempt has not trained a step yet: the fault waits for it
                pid = int(pid_file.read_text())
                pid_file.unlink()
                try:
                    os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                    sent.append({"t": time.time(), "rank": rank, "kind": kind, "pid": pid})
                except ProcessLookupError:
                    continue
                next_fault = time.time() + a.fault_every
        end = time.time()
    finally:
        # torchrun starts each rank in a session of its own: the agents' children first, then the agents' groups
        for pid in children({p.pid for p in procs}) + [f["pid"] for f in sent]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    steps = []
    path = work / "steps.rank0.jsonl"
    if path.exists():
        steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    tokens_per_step = int(data["batch_size"]) * int(data["seq_len"]) * 2
    return {"start": start or end, "end": end, "steps": steps, "faults": sent, "tokens_per_step": tokens_per_step,
            "codes": [p.returncode for p in procs]}


def figures(job: dict) -> dict[str, Any]:
    steps, wall = job["steps"], max(1e-9, job["end"] - job["start"])
    reached = max((s["step"] for s in steps), default=0)
    counted = reached - (steps[0]["step"] if steps else 0)  # from the first step's end, as the wall time
    out: dict[str, Any] = {"wall_s": wall, "steps": reached, "trained": len(steps),
                           "goodput": counted * job["tokens_per_step"] / wall, "faults": []}
    for f in job["faults"]:
        before = [s for s in steps if s["t"] <= f["t"]]
        after = [s for s in steps if s["t"] > f["t"]]
        if not before:
            continue
        was = before[-1]["step"]
        later = [s for s in after if s["attempt"] > before[-1]["attempt"]]
        if not later:
            out["faults"].append({**f, "recovered": False})
            continue
        first = later[0]
        beyond = next((s for s in later if s["step"] > was), None)
        out["faults"].append({"kind": f["kind"], "rank": f["rank"], "recovered": True,
                              "steps_lost": was - (first["step"] - 1),
                              "to_first_step_s": first["t"] - f["t"],
                              "to_progress_s": beyond["t"] - f["t"] if beyond else None})
    return out


def restart_tries(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``--restart-tries``: a SIGKILLed rank under torchrun --max-restarts 1, N times (tests/scripts/recover_fit.py)."""
    import torch

    script = REPO / "tests" / "scripts" / "recover_fit.py"

    def launch(cfg: dict, restarts: int) -> int:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
               str(restarts), "--master-port", str(_free_port()), str(script), json.dumps(cfg)]
        with open(Path(cfg["out"] + ".log"), "w") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
            try:
                return p.wait(timeout=a.timeout)
            except subprocess.TimeoutExpired:
                return -1
            finally:
                for pid in children({p.pid}):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()

    base = {"steps": 30, "samples": 64, "every": 5}
    ref = {**base, "out": str(work / "reference")}
    assert launch(ref, 0) == 0, f"the uninterrupted run failed: {ref['out']}.log"
    want = torch.load(Path(ref["out"]) / "final.pt")
    result: dict[str, Any] = {}
    for arm in (["fixed", "control"] if a.control else ["fixed"]):
        ok = 0
        tries = []
        for i in range(a.restart_tries):
            cfg = {**base, "out": str(work / f"{arm}{i}"), "fault": "kill", "victim": 1, "at": 13,
                   "unprefixed": arm == "control"}
            t0 = time.time()
            code = launch(cfg, 1)
            final = Path(cfg["out"]) / "final.pt"
            equal = final.exists() and all(torch.equal(v, torch.load(final)[k]) for k, v in want.items())
            mesh = "connectFullMesh" in Path(cfg["out"] + ".log").read_text()
            tries.append({"exit": code, "equal": equal, "connectFullMesh": mesh, "seconds": time.time() - t0})
            ok += code == 0 and equal
            print(f"{arm} try {i + 1}: exit {code}, final weights {'equal' if equal else 'NOT equal'}"
                  f"{', connectFullMesh failed' if mesh else ''} ({tries[-1]['seconds']:.0f} s)", flush=True)
        result[arm] = {"recovered": ok, "tries": a.restart_tries, "each": tries}
        print(f"{arm}: {ok} of {a.restart_tries} recovered by themselves, bitwise equal to the uninterrupted run")
    return result


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(HERE / "configs" / "small.yaml"), help="the recipe config (its model)")
    p.add_argument("--minutes", type=float, default=10.0, help="length of the faulted run")
    p.add_argument("--baseline-minutes", type=float, default=None, help="the fault-free run (default: --minutes)")
    p.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults")
    p.add_argument("--faults", default="kill,stop", help="the faults in turn: kill (SIGKILL), stop (SIGSTOP)")
    p.add_argument("--every", type=int, default=10, help="a checkpoint every N steps")
    p.add_argument("--heartbeat", type=float, default=10.0, help="heartbeat_timeout (s): how soon a stop is seen")
    p.add_argument("--batch", type=int, default=0, help="sequences per rank and step (0: the config's)")
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--max-bytes", type=int, default=0, help="corpus bytes (0: the config's)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--no-netns", action="store_true", help="both nodes on loopback")
    p.add_argument("--restart-tries", type=int, default=0, help="run N restart tries instead (module docstring)")
    p.add_argument("--control", action="store_true", help="with --restart-tries: the unprefixed store too")
    p.add_argument("--timeout", type=float, default=300, help="seconds per restart try, or for a run's start-up")
    p.add_argument("--json", default=None)
    p.add_argument("--keep", default=None, help="a folder that keeps the runs' logs and checkpoints")
    p.add_argument("--smoke", action="store_true", help="tiny settings for CI (explicit options still win)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)
    a = p.parse_args(argv)
    if a.worker:
        worker(json.loads(a.worker))
        return {}
    if bad := [k for k in a.faults.split(",") if k not in ("kill", "stop")]:
        p.error(f"--faults {bad}: allowed are kill, stop")
    print(cpu_line(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_faults_") as tmp:
        if a.keep:
            tmp = a.keep
        if a.restart_tries:
            result = {"restart_tries": restart_tries(a, Path(tmp))}
        else:
            netns = not a.no_netns and os.geteuid() == 0
            with (Namespaces(2) if netns else _nothing()) as ns:
                base = figures(run_job(a, a.baseline_minutes or a.minutes, False, ns, Path(tmp) / "baseline"))
                print(f"fault-free: {base['steps']} steps in {base['wall_s']:.0f} s, {base['goodput']:.0f} tokens/s",
                      flush=True)
                faulted = figures(run_job(a, a.minutes, True, ns, Path(tmp) / "faulted"))
            for f in faulted["faults"]:
                if f["recovered"]:
                    print(f"  {f['kind']} rank {f['rank']}: {f['steps_lost']} steps lost, first step after"
                          f" {f['to_first_step_s']:.1f} s, beyond the fault's step after "
                          f"{f['to_progress_s'] if f['to_progress_s'] is None else round(f['to_progress_s'], 1)} s")
                else:
                    print(f"  {f['kind']} rank {f['rank']}: not recovered before the end")
            ratio = faulted["goodput"] / base["goodput"] if base["goodput"] else float("nan")
            print(f"faulted: {faulted['steps']} steps in {faulted['wall_s']:.0f} s, {faulted['goodput']:.0f}"
                  f" tokens/s, {len(faulted['faults'])} faults: goodput {100 * ratio:.1f}% of the fault-free run"
                  f" ({'network namespaces' if netns else 'loopback'})")
            result = {"baseline": base, "faulted": faulted, "goodput_ratio": ratio, "netns": netns}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


if __name__ == "__main__":
    main()
