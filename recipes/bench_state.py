"""Benchmark: HorizonStrategy(state="replicated") against state="node_sharded" on one node (or ``--nodes`` emulated
ones), 2 and 4 ranks, and against what a user would pick instead: torch's FSDP2 and DeepSpeed's ZeRO-2 and ZeRO-3.

The arms (``--arms``): replicated, node_sharded (one shared copy of the weights per node), node_sharded-copies
(``node_weights="copies"``: a copy per rank, the owners' updates broadcast inside the node after each step),
fsdp2 (``fully_shard`` on every block and the model, under Lightning's ``ModelParallelStrategy`` with
``data_parallel_size`` = ranks; with ``--precision bf16-true-fp32`` its bf16 ``MixedPrecisionPolicy``), and
deepspeed-zero2 / deepspeed-zero3 (ZeRO stage 2: gradients and optimizer state partitioned over the ranks; stage 3:
the weights too). DeepSpeed is an optional extra (``DS_BUILD_OPS=0 pip install 'lightning-horizon[deepspeed]'``):
where it does not import, its arms are skipped with a line saying why and how to install it, and the rest run.

    python recipes/bench_state.py                                           # 2 and 4 ranks, fp32, 2 rounds
    python recipes/bench_state.py --ranks 2,4 --precision bf16-true-fp32 --fit-memory 2GiB
    python recipes/bench_state.py --arms replicated,node_sharded,fsdp2,deepspeed-zero2,deepspeed-zero3 --rounds 1
    python recipes/bench_state.py --nodes 2 --ranks 4 --arms replicated,node_sharded   # 2 emulated nodes x 2 ranks
    python recipes/bench_state.py --smoke --arms replicated,node_sharded,fsdp2 --fit-memory 4GiB  # CI: 3 runs

Each arm (state x ranks) trains the recipes' GPTPretrain (recipes/pretrain_gpt.py: AdamW, same seed) on the byte
corpus of recipes/lm_data.py for ``--warmup`` + ``--steps`` steps, in a fresh process group (tune.run_worker: its
own session, killed on timeout); Lightning's launcher starts the other ranks. Every round runs every arm once, in a
rotated order, so a noisy neighbour hits both states alike. ``--batch`` is per rank; every rank runs
``HorizonStrategy(state=..., threads_per_rank=max(1, cores // ranks))`` (more ranks than cores: oversubscribed,
1 thread each, which the output says). ``--precision 32-true`` is Lightning's fp32; ``bf16-true-fp32`` is
``HorizonPrecision("bf16-true", master="fp32")`` (bf16 weights and gradients, fp32 masters).

``--nodes N`` splits every rank count into N emulated nodes on this machine: our arms run
``HorizonStrategy(ranks_per_node=ranks/N)`` (node_sharded: one copy of the weights and the state sharded per node;
gradients synchronised inside each node, then across), and the table is per emulated node: training state, PSS sum
and training added are the largest node's sum over its ranks, the cgroup's peak (it measures the whole machine) is
divided by N, as the output says; bytes per step are split intra / inter-node as comm_metrics() counts them. fsdp2
and the DeepSpeed arms know no nodes: they run one flat world (marked "flat"), their per-node figures taken from
their ranks grouped as a launcher would place them, their bytes not split.

A DeepSpeed arm is no Trainer: Lightning 2.6's ``DeepSpeedStrategy`` refuses CPU accelerators. Its worker is rank 0
of a plain training loop over ``deepspeed.initialize``'s engine and starts ranks 1.. itself, as Lightning's launcher
does for the other arms (same command; ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` in the
environment; ``deepspeed.init_distributed(dist_backend="gloo")`` with ``DS_ACCELERATOR=cpu``). The same model class,
seed, data (ByteCorpusDataModule's windows through its ResumableSampler), global batch and steps; the optimizer and
schedule are GPTPretrain.configure_optimizers' own, handed to ``deepspeed.initialize``: torch's fused AdamW (it
runs on the CPU; ZeRO steps it on its fp32 partitions, hence ``zero_allow_untested_optimizer``), not
DeepSpeedCPUAdam, and its warm-up + cosine LambdaLR. ZeRO's config is its defaults but ``gradient_clipping`` 0 (its
default 1.0 clips; no other arm does); with ``--precision bf16-true-fp32`` ``"bf16": {"enabled": true}``: bf16
weights and gradients, fp32 master partitions in ZeRO's optimizer, the gradients reduced in bf16 (DeepSpeed's
default communication dtype; FSDP2's policy reduces in fp32). Its steps are timed by the same StepTimer, whose hooks
the loop calls. DeepSpeed's CPU accelerator builds a small shared-memory op with g++ in ``init_distributed`` (cached
under ~/.cache/torch_extensions); its training collectives go through gloo.

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
  what the issue's target is about, without activations, allocator slack or the interpreter. Of a ZeRO rank: the
  weights as ZeRO keeps them (stage 2: whole; stage 3: this rank's partitions, ``ds_tensor``, and the parameters
  under its ``stage3_param_persistence_threshold``, kept whole), the fp32 partitions its optimizer steps (a copy of
  their own, in fp32 too), their gradients and the AdamW state. ZeRO frees its gradients inside ``step()``: at the
  step's end it holds none where the Trainer's arms still hold theirs (the peak memory sees them).
- training added per node: the same PSS maxima minus each rank's PSS before it built the model, summed: the model,
  its training state, the activations and what the allocator keeps, without the interpreter, torch and Lightning
  (~300 MiB a rank), which every state pays alike.
- peak RSS per rank (``VmHWM``, the largest rank), tokens/s (tune.StepTimer / tune.measure: the median step after
  the warm-up; the median over rounds, min-max shown), and the bytes all ranks together sent in the last step
  (``trainer.strategy.comm_metrics()`` read after that step: ``comm/intra_bytes`` + ``comm/inter_bytes``, of the
  GradientSync when replicated, of the owners' gradient path and the weights' broadcasts when node-sharded; fsdp2 has no such count: its bytes are
  computed from its collectives' sizes; DeepSpeed's from the sizes of the collectives ZeRO called in the last step,
  as DeepSpeed's comms logger sees them (its record replaced by ours, sizes only), each turned into what a ring moves
  per rank: all-reduce 2(R-1)/R of the tensor, all-gather R-1 shards, reduce-scatter (R-1)/R, any other (ZeRO-3's
  broadcasts) its size once). Also shown: the share of the machine other processes took meanwhile
  (StepTimer's "foreign"; above a few percent, tokens/s measured the neighbours too) and rank 0's loss at the last
  step (same seed, data and global batch: the two states should agree).

What compares across all arms: model, data, seed, global batch, optimizer, schedule and steps; rank 0's last loss
(in fp32 the same to ~1e-4); the memory method. What does not quite: the DeepSpeed arms run a plain loop, without
the Trainer's hooks and logging (a little less time and memory a step); ``deepspeed.initialize`` imports some 560
modules more (torch._inductor, functorch, networkx), ~40 MiB a rank counted as training added; ZeRO's buckets are
allocated at ``reduce_bucket_size`` (5e8 elements) and charged only as far as they are touched; ZeRO-3 at its
defaults keeps the parameters it gathered for the forward for the backward (``stage3_max_reuse_distance``).

``--fit-memory SIZE`` then searches, for each state (and FSDP2 or ZeRO where an arm) at the largest ``--ranks``, the
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
#: DeepSpeed's ZeRO, stage 2 (gradients and optimizer state partitioned) and 3 (the weights too): a plain training
#: loop in every rank (:func:`zero_worker`), an optional extra (``pip install 'lightning-horizon[deepspeed]'``)
ZERO = {"deepspeed-zero2": 2, "deepspeed-zero3": 3}
#: what a user would pick instead, in the same table: torch's FSDP2 (``fully_shard`` on every block, then on the
#: model) under Lightning's ``ModelParallelStrategy(data_parallel_size=ranks)``; with ``--precision bf16-true-fp32``
#: its ``MixedPrecisionPolicy`` computes in bf16 on the fp32 sharded parameters and reduces in fp32 (the counterpart
#: of bf16-true with fp32 masters); and DeepSpeed's ZeRO
FOREIGN = ("fsdp2", *ZERO)
#: how to get the DeepSpeed arms, in the line that says they were skipped
DEEPSPEED_INSTALL = "DS_BUILD_OPS=0 pip install 'lightning-horizon[deepspeed]' (deepspeed==0.19.8)"
#: bytes a ring moves per rank for one call of each collective of size ``s`` bytes on ``n`` ranks, ``s`` as DeepSpeed's
#: comms logger takes it (the call's ``tensor`` argument: of all_gather_into_tensor the input shard, of all_reduce
#: and reduce_scatter_tensor the whole tensor); any other collective counts ``s`` once
RING = {"all_reduce": lambda s, n: 2 * (n - 1) / n * s, "all_gather_into_tensor": lambda s, n: (n - 1) * s,
        "reduce_scatter_tensor": lambda s, n: (n - 1) / n * s}
#: comm_metrics() keys (and the foreign arms' computed one) by where the bytes went: intra-node, inter-node, or
#: one flat world that does not tell
INTRA, INTER, FLAT = ("intra_bytes",), ("inter_bytes",), ("computed_bytes",)
PRECISIONS = ("32-true", "bf16-true-fp32")
MIB = 2**20
SMOKE = dict(n_layer=1, n_head=2, n_embd=64, seq=32, batch=2, warmup=1, steps=1, rounds=1, ranks="2",
             fit_max_embd=64, fit_steps=2, max_bytes=2**20)


# ---------------------------------------------------------------------------------------------- worker side


def worker(spec: dict[str, Any], out: str) -> None:
    if spec["state"] in ZERO:
        return zero_worker(spec, out)
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
        return {"computed_bytes": int((ranks - 1) / ranks * numel * (2 * width + 4))}

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
        strategy = HorizonStrategy(**ARMS[spec["state"]], threads_per_rank=spec["threads"],
                                   ranks_per_node=spec["ranks"] // spec["nodes"] if spec["nodes"] > 1 else None)
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


def zero_worker(spec: dict[str, Any], out: str) -> None:
    """A DeepSpeed ZeRO arm: every rank runs a plain training loop over ``deepspeed.initialize``'s engine (Lightning
    2.6's DeepSpeedStrategy refuses CPU accelerators). The process run_worker started is rank 0 and starts the
    others itself, as Lightning's launcher does for the other arms: the same command, their rank in the
    environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` for ``deepspeed.init_distributed``
    over gloo). The same model, seed, sampler, optimizer and schedule as under the Trainer: GPTPretrain's own
    ``configure_optimizers`` (torch's fused AdamW, its warm-up and cosine), each rank's batch from the same
    ResumableSampler; the step times through the other arms' StepTimer, its hooks called from the loop with a
    stand-in for the Trainer (the world size and the rank are all it reads of one); the Probe's per-rank file."""
    import subprocess
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    children = []
    if "RANK" not in os.environ:  # the launching process: rank 0, starting ranks 1..R-1
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_network_port()),
                          WORLD_SIZE=str(spec["ranks"]), LOCAL_WORLD_SIZE=str(spec["ranks"]), RANK="0", LOCAL_RANK="0")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec), "--out", out]
        children = [subprocess.Popen(cmd, env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r)})
                    for r in range(1, spec["ranks"])]
    import deepspeed
    import lightning as L
    import torch
    from deepspeed.comm.comm import comms_logger
    from torch.utils.data import DataLoader

    from lightning_horizon.layout import StepTimer
    from lightning_horizon.memory import current_pss
    from lm_data import ByteCorpusDataModule, ResumableSampler
    from pretrain_gpt import GPTPretrain

    deepspeed.init_distributed(dist_backend="gloo")
    rank, ranks = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.set_num_threads(spec["threads"])  # as HorizonStrategy's threads_per_rank does for our arms
    L.seed_everything(1337, verbose=False)
    base = current_pss()  # before this rank builds the model, as the Probe's
    module = GPTPretrain(**spec["model"])
    module.trainer = SimpleNamespace(estimated_stepping_batches=spec["steps"])  # what configure_optimizers reads
    conf = module.configure_optimizers()
    module.trainer = None
    config = {"train_micro_batch_size_per_gpu": spec["data"]["batch_size"], "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0,  # ZeRO's default is 1.0; the other arms do not clip
              "zero_optimization": {"stage": ZERO[spec["state"]]},
              "zero_allow_untested_optimizer": True,  # torch's AdamW on ZeRO's fp32 partitions
              "bf16": {"enabled": spec["precision"] == "bf16-true-fp32"},  # bf16 weights, fp32 masters in ZeRO
              "comms_logger": {"enabled": True, "prof_all": True}, "steps_per_print": 2**62}
    engine, optimizer, *_ = deepspeed.initialize(model=module, optimizer=conf["optimizer"],
                                                 lr_scheduler=conf["lr_scheduler"]["scheduler"], config=config)
    calls: list[tuple[str, int]] = []  # (collective, size) of every call ZeRO makes: the logger's record, ours
    comms_logger.append = lambda op, _name, _seconds, size: calls.append((op, size))
    data = ByteCorpusDataModule(**spec["data"])
    data.setup("fit")
    loader = DataLoader(data.train_set, batch_size=data.batch_size, drop_last=True,
                        sampler=ResumableSampler(data.train_set, ranks, rank, data.seed))
    with torch.device("meta"):
        meta = GPTPretrain(**spec["model"])  # what StepTimer reads of the module: hyperparameters and sizes
    timer, trainer = StepTimer(), SimpleNamespace(world_size=ranks, global_rank=rank)
    pss, state, loss, sent = 0, 0, float("nan"), 0
    for i, (x, y) in zip(range(spec["steps"]), loader):
        calls.clear()
        step_loss = module._loss(engine(x), y)  # GPTPretrain.training_step without its self.log
        engine.backward(step_loss)
        engine.step()
        timer.on_train_batch_end(trainer, meta, None, (x, y), i)
        pss, state, loss = max(pss, current_pss()), max(state, zero_state_bytes(module, optimizer)), float(step_loss)
        sent = int(sum(RING.get(op, lambda s, n: s)(size, ranks) for op, size in calls))
    timer.on_train_end(trainer, meta)
    collectives: dict[str, int] = {}
    for op, _ in calls:
        collectives[op] = collectives.get(op, 0) + 1
    Path(f"{out}.rank{rank}.json").write_text(json.dumps({
        "pss": pss, "base": base, "state": state, "comm": {"computed_bytes": sent}, "loss": loss,
        "comm_after_fit": dict(sorted(collectives.items()))}))  # the last step's calls of each collective
    torch.distributed.destroy_process_group()
    failed = [c.returncode for c in children if c.wait() != 0]
    if failed:
        raise SystemExit(f"{spec['state']}: {len(failed)} of ranks 1..{ranks - 1} failed (exit {failed})")


def zero_state_bytes(module: Any, optimizer: Any) -> int:
    """The training state a ZeRO rank holds in live tensors: the model's weights (ZeRO-3: this rank's partitions,
    ``ds_tensor``, and the parameters it keeps whole), the fp32 partitions torch's AdamW steps (the keys of its
    state: ZeRO-3 empties its param_groups between steps), their gradients and its state; each storage once. ZeRO's
    communication buckets are not counted: allocated at their configured size, they are touched only as far as
    they are used (the peak memory sees what was)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO's optimizer wraps torch's
    tensors = [t for p in module.parameters() for t in (p.data, getattr(p, "ds_tensor", None), p.grad)]
    tensors += [t for p, st in inner.state.items() for t in (p, p.grad, *st.values())]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if hasattr(t, "untyped_storage")}
    return sum(storages.values())


def deepspeed_missing() -> Optional[str]:
    """Why the DeepSpeed arms cannot run here, or None: deepspeed is an optional extra, and CI has none."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # its CPU accelerator, named: chosen at import, without a warning
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        return f"deepspeed is not importable ({e}); install it with {DEEPSPEED_INSTALL}"
    return None


# ---------------------------------------------------------------------------------------------- driver side


def run_arm(state: str, ranks: int, a: argparse.Namespace, n_embd: int, warmup: int, steps: int,
            tmp: Path) -> dict[str, Any]:
    """One arm in a fresh process group: its figures, or ``{"ok": False, "note": ...}``. Memory and state per node:
    the ranks in ``a.nodes`` groups of consecutive ranks (our arms' emulated nodes; a flat world's ranks as a
    launcher would place them), the largest group's sum, or the cgroup's whole-machine peak divided by the nodes."""
    from lightning_horizon.layout import Layout
    from lightning_horizon.layout.timer import OUT_ENV, WARMUP_ENV
    from lightning_horizon.layout.tuner import clean_env, measure, run_worker

    threads = max(1, len(os.sched_getaffinity(0)) // ranks)
    spec = {"state": state, "ranks": ranks, "nodes": a.nodes, "threads": threads, "precision": a.precision,
            "steps": warmup + steps,
            "model": {"n_layer": a.n_layer, "n_head": a.n_head, "n_embd": n_embd, "block_size": a.seq},
            "data": {"seq_len": a.seq, "batch_size": a.batch, "max_bytes": a.max_bytes, "cache_dir": a.cache_dir}}
    out = tmp / uuid.uuid4().hex[:12]
    env = clean_env()  # a clean shell, as tune's workers
    env.update({OUT_ENV: f"{out}.json", WARMUP_ENV: str(warmup), "DS_ACCELERATOR": "cpu"})  # DeepSpeed's CPU one
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
    per_rank = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(ranks)]
    per_node = ranks // a.nodes

    def node_sum(figure: Any) -> int:  # the largest node's sum of a per-rank figure
        return max(sum(figure(r) for r in per_rank[n:n + per_node]) for n in range(0, ranks, per_node))

    pss_sum = node_sum(lambda r: r["pss"])
    added = node_sum(lambda r: r["pss"] - r["base"])  # the model, its training state and activations
    state = node_sum(lambda r: r["state"])
    intra, inter, flat = (sum(v for r in per_rank for k, v in r["comm"].items() if k.endswith(ends))
                          for ends in (INTRA, INTER, FLAT))
    return {"ok": res.status == "ok", "note": res.note, "tps": res.throughput, "rss": max(res.peak_rss),
            "pss_sum": pss_sum, "added": added, "state_bytes": state,
            "node": cgroup_peak // a.nodes if cgroup_peak is not None else pss_sum, "sent": intra + inter + flat,
            "intra": intra, "inter": inter, "flat": flat,
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


def sent_text(row: dict[str, Any]) -> str:
    """Bytes all ranks sent in a step, MiB: ``total (intra / inter)``, or ``total (flat world)`` for an arm that
    does not tell."""
    if row["flat"]:
        return f"{row['sent'] / MIB:,.2f} (flat world)"
    return f"{row['sent'] / MIB:,.2f} ({row['intra'] / MIB:,.2f} / {row['inter'] / MIB:,.2f})"


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="rank counts on this machine, comma-separated")
    p.add_argument("--nodes", type=int, default=1, help="emulated nodes each rank count is split into (our arms'"
                   " ranks_per_node = ranks / nodes; fsdp2 and deepspeed run one flat world)")
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
    if a.nodes < 1 or any(r % a.nodes for r in ranks):
        p.error(f"--nodes={a.nodes}: allowed is an int >= 1 dividing every --ranks count ({a.ranks})")
    unknown = [x for x in a.arms.split(",") if x not in (*ARMS, *FOREIGN)]
    if unknown:
        p.error(f"--arms={a.arms!r}: {', '.join(unknown)} unknown; allowed are {', '.join((*ARMS, *FOREIGN))}")
    chosen = list(dict.fromkeys(a.arms.split(",")))
    why = deepspeed_missing() if set(chosen) & set(ZERO) else None
    skipped = {x: why for x in chosen if x in ZERO} if why else {}
    if skipped:  # an optional extra: the bench goes on without them
        print(f"{', '.join(skipped)} skipped: {why}", flush=True)
        chosen = [x for x in chosen if x not in skipped]
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
    if a.nodes > 1:
        peak = f"the cgroup's peak is the whole machine's divided by {a.nodes}" if cg else "the peak is the PSS sum"
        print(f"emulated nodes: every rank count split into {a.nodes} nodes on this machine (our arms:"
              f" HorizonStrategy(ranks_per_node=ranks/{a.nodes})); fsdp2 and deepspeed know no nodes and run one flat"
              " world (\"flat\"), their ranks grouped per node as a launcher would place them. Per node: training"
              f" state, PSS sum and training added are the largest node's sum over its ranks; {peak}", flush=True)
    for r in ranks:
        if r > cores:
            print(f"note: {r} ranks on {cores} cores: oversubscribed (1 thread per rank); its tokens/s compares the"
                  " two states, it is no scaling figure", flush=True)
    ByteCorpusDataModule(max_bytes=a.max_bytes, cache_dir=a.cache_dir).prepare_data()  # the token cache, once
    arms = [(r, s) for r in ranks for s in chosen]
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="bench_state_") as tmp:
        for rnd in range(a.rounds if arms else 0):
            for r, s in arms[rnd % len(arms):] + arms[:rnd % len(arms)]:  # rotated: no arm always first
                res = run_arm(s, r, a, a.n_embd, a.warmup, a.steps, Path(tmp))
                if not res["ok"]:
                    raise RuntimeError(f"{s} @ {r} ranks failed: {res['note']}\n{res.get('log', '')[-3000:]}")
                runs[(r, s)].append(res)
                print(f"  round {rnd + 1}: {r} ranks {s:<15} {res['tps']:>9,.0f} tok/s  node peak"
                      f" {res['node'] / MIB:,.0f} MiB  PSS sum {res['pss_sum'] / MIB:,.0f} MiB (training added"
                      f" {res['added'] / MIB:,.0f})  max rank RSS"
                      f" {res['rss'] / MIB:,.0f} MiB  sent {sent_text(res)} MiB/step  others' load"
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
                  " peak RSS per rank (max) MiB | tokens/s (min-max) | others' load | sent per step, all ranks MiB"
                  " (intra / inter-node) | last loss, rank 0 |")
        print("\n" + header + "\n|" + "|".join("---" for _ in header.split("|")[1:-1]) + "|")
        for row in rows:
            where = "" if a.nodes == 1 else " flat" if row["state"] in FOREIGN else f" on {a.nodes} nodes"
            print(f"| {row['ranks']} x {row['threads']}{where} | {row['state']} | {row['state_bytes'] / MIB:,.0f} |"
                  f" {row['node'] / MIB:,.0f} |"
                  f" {row['pss_sum'] / MIB:,.0f} | {row['added'] / MIB:,.0f} | {row['rss'] / MIB:,.0f} |"
                  f" {row['tps']:,.0f} ({row['min']:,.0f}-"
                  f"{row['max']:,.0f}) | {100 * row['foreign']:.0f}% | {sent_text(row)} | {row['loss']:.4f} |")
            base = next((x for x in rows if x["ranks"] == row["ranks"] and x["state"] == "replicated"), None)
            if row["state"] != "replicated" and base is not None:
                q = {k: f"{row[k] / base[k]:.2f}x" if base[k] else "-"
                     for k in ("state_bytes", "node", "pss_sum", "added", "rss", "tps", "sent")}
                print(f"| {row['ranks']} | {row['state']} / replicated | {q['state_bytes']} | {q['node']} |"
                      f" {q['pss_sum']} | {q['added']} |"
                      f" {q['rss']} |"
                      f" {q['tps']} | | {q['sent']} | |")
        for r, other in ((r, other) for r in ranks for other in FOREIGN):  # our sharded state against theirs
            ours, theirs = (next((x for x in rows if x["ranks"] == r and x["state"] == s), None)
                            for s in ("node_sharded", other))
            if ours and theirs:
                print(f"{r} ranks, node_sharded / {other}: training state per node"
                      f" {ours['state_bytes'] / theirs['state_bytes']:.2f}x, peak memory per node"
                      f" {ours['node'] / theirs['node']:.2f}x, tokens/s {ours['tps'] / theirs['tps']:.2f}x, last loss"
                      f" {ours['loss']:.4f} vs {theirs['loss']:.4f}")
        for x in {x["state"]: x for x in rows if x["state"] not in FOREIGN}.values():
            print(f"{x['state']}: bytes per step = the sum over ranks of comm_metrics()'s"
                  f" {', '.join(k for k in x['comm_keys'] if 'bytes' in k) or 'nothing'}; comm_metrics() after fit:"
                  f" {', '.join(x['after_fit']) or 'empty'}")
        if any(x["state"] == "fsdp2" for x in rows):
            print("fsdp2: bytes per step computed from its collectives' sizes (two all-gathers of the parameters in"
                  " the compute dtype, a reduce-scatter of fp32 gradients, (R-1)/R of each per rank), not counted")
        for x in {x["state"]: x for x in rows if x["state"] in ZERO}.values():
            print(f"{x['state']}: bytes per step from the sizes of the collectives ZeRO called in the last step"
                  f" (DeepSpeed's comms logger; {', '.join(f'{op} x {n}' for op, n in x['after_fit'].items())}"
                  " on rank 0), each as a ring moves it per rank; a plain loop over deepspeed.initialize's engine,"
                  " not Lightning")
        fit = {}
        if a.fit_memory:
            print(f"\n--fit-memory {a.fit_memory / MIB:,.0f} MiB per node, {max(ranks)} ranks, n_embd ladder 64.."
                  f"{a.fit_max_embd} step 64 ({a.n_layer} layers, {a.n_head} heads), {a.fit_steps} steps each:",
                  flush=True)
            searched = [*STATES, *(x for x in FOREIGN if x in chosen)]
            for s in searched:
                best = fit_search(s, max(ranks), a, Path(tmp), {(x["ranks"], x["state"]): x for x in rows})
                fit[s] = {"n_embd": best, "params": parameters(a, best) if best else 0}
            for s in searched:
                what = (f"n_embd {fit[s]['n_embd']}, {fit[s]['params'] / 1e6:.2f}M params" if fit[s]["n_embd"]
                        else "none of the ladder fits")
                print(f"  largest {s}: {what}")
            rep, sh = fit["replicated"]["params"], fit["node_sharded"]["params"]
            print(f"  ratio node_sharded / replicated (parameters that fit): {f'{sh / rep:.2f}x' if rep else '-'}")
            for other in (x for x in FOREIGN if x in fit):
                theirs = fit[other]["params"]
                ratio = f"{sh / theirs:.2f}x" if theirs else "-"
                print(f"  ratio node_sharded / {other} (parameters that fit): {ratio}")
    finished = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"{started} .. {finished}")
    result = {"method": method, "rows": rows, "fit": fit, "skipped": skipped, "started": started,
              "finished": finished,
              "args": {k: v for k, v in vars(a).items() if k not in ("worker", "out")}}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
