"""Where a training step's time goes: the recipe's GPT under the real Trainer, profiled, broken down by category.

    python recipes/profile_step.py                                          # small.yaml, 1 process, 5 + 10 steps
    python recipes/profile_step.py --config recipes/configs/tiny.yaml --warmup 2 --steps 2        # a quick look
    python recipes/profile_step.py --smoke                   # CI: the same, and a matmul peak of one size (512)
    python recipes/profile_step.py --optimizer-impl foreach --attention manual --threads-per-rank 1
    python recipes/profile_step.py --devices 4 --threads-per-rank 4 --bucket-mb 25 --trace step.json   # big node
    python recipes/profile_step.py --gemms      # and the model's weight matmuls alone at their shapes: what they allow

It trains ``pretrain_gpt.GPTPretrain`` (model and data sections of ``--config``) with what the recipe uses:
HorizonStrategy, HorizonPrecision("auto") and GradNormBackoff(max_norm=1.0), on ``--devices`` ranks (Lightning's
launcher starts the others; the config's ``batch_size`` is the global batch, split over the ranks, as in
bench_vs_lightning.py). ``--warmup`` steps run first; intervals of the later half of them are the unprofiled
step time. Then torch.profiler (CPU activity, no shapes, no stack) records ``--steps`` steps on rank 0.

Method (no double counting). The window is the wall time from the end of the last warm-up step to the end of the
last profiled step (every interval between consecutive ``on_train_batch_end`` calls: data loading, forward,
backward, gradient sync, optimizer, Lightning's loop). Only the training thread's events count (the thread of
the script's markers; CPU backward runs on it too; gloo's worker threads are listed apart, not summed). Each event
contributes its *self* time (its own time minus its children's) to exactly one category, chosen by

1. the nearest enclosing *region*: ``Optimizer.step#`` / ``Optimizer.zero_grad#`` (optimizer), the DataLoader's
   ``enumerate(DataLoader)#`` (data loading), a collective (``gloo:``, ``c10d::``, ``allreduce``, ...: gradient
   sync), or the script's own markers around Lightning's closure (forward + backward) and the backward in it.
   Lightning runs the closure *inside* ``optimizer.step``, so the closure marker ends the optimizer region:
   "optimizer step" is the whole step region minus the closure (the AdamW kernels, the grad norm / clipping of
   GradNormBackoff and the precision plugin, the step's Python);
2. inside the closure, the nearest enclosing (or the event's own) op name: ``aten::linear`` -> ``aten::addmm`` ->
   matmul; an autograd node (``AddmmBackward0``, ``autograd::engine::evaluate_function: ...``) by its forward op;
   ops that match nothing (embedding, copies, views, gradient accumulation) are "other ops";
3. everything not covered by an op (Lightning's loop and callbacks, Python between ops, the markers' own self
   time, the autograd engine) is "other / Python overhead" = window minus the attributed self times. So the rows
   sum to 100% by construction; a negative overhead would mean double counting. With several ranks, the backward
   marker's own time is DDP waiting for the last buckets' allreduce (overlapped, on gloo's threads): it goes to
   gradient sync, with the collectives' own calls.

With ``attention="manual"`` or ``"blocked"`` (``"auto"``'s choice up to 1,024 tokens in bf16, 512 in fp32) the
attention's matmuls count as matmul and its softmax as softmax; "attention" is the fused
``scaled_dot_product_attention`` kernel (forward and backward). MFU = ``gpt.train_flops_per_token`` x tokens/s
(global, unprofiled steps) over the matmul peak of the compute dtype, measured in this process on all its cores
before training (bench_vs_lightning's measurement). The profiler itself costs time (each op records an
event): compare the profiled and unprofiled step times printed above the table.

``--gemms``: after training, every distinct ``nn.Linear`` shape's three matmuls (forward ``x @ W^T``, input
gradient ``dy @ W``, weight gradient ``dy^T @ x``, the layouts autograd passes to ``mm``) timed alone on the
training's thread count, in the compute dtype, each the fastest of 5 calls: GFLOP/s per GEMM, and all of them,
weighted by the layers of each shape, as a share of the peak. At narrow widths these GEMMs run well below the
square matmuls of the peak: that share is the best rate the step's weight matmuls reach, whatever the rest costs
(the MFU also counts the attention's FLOPs, so it passes the share only as far as the attention adds work).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
HERE = Path(__file__).resolve().parent

ROWS = ("matmul", "attention", "layer norm", "softmax / cross-entropy", "elementwise / GELU", "other ops",
        "optimizer step", "gradient sync", "data loading", "other / Python overhead")
#: --smoke: tiny.yaml, the fewest steps, a short matmul peak of one size (explicit options still win)
SMOKE = dict(config=str(HERE / "configs" / "tiny.yaml"), warmup=2, steps=2, peak_seconds=0.1, peak_sizes=(512,))
MARK = "profile_step#closure"  # the script's marker around Lightning's closure (forward, zero_grad, backward)
BACKWARD = "profile_step#backward"  # and around the backward inside it
_NODE = re.compile(r"^(autograd::engine::evaluate_function: )?(.*?)(Backward\d*)?$")
# op categories, matched in this order on the op's base name (aten:: and an autograd node's suffix stripped)
_OPS = (
    ("attention", re.compile(r"scaled_dot_product|flash_attention|efficient_attention|sdpa", re.I)),
    ("matmul", re.compile(r"^(aten::)?(_?mm|addmm|bmm|baddbmm|addbmm|linear|matmul|einsum|mkldnn_.*matmul.*|"
                          r"_?mkldnn_linear.*|mv|dot)$|^(Mm|Addmm|Bmm|Baddbmm|Linear|Matmul|Mv|Dot)$")),
    ("layer norm", re.compile(r"layer_norm|LayerNorm|rms_norm|RmsNorm", re.I)),
    ("softmax / cross-entropy", re.compile(r"softmax|nll_loss|cross_entropy|NllLoss|LogSoftmax", re.I)),
    ("elementwise / GELU", re.compile(r"^(aten::)?(gelu|add|add_|mul|mul_|div|div_|sub|sub_|rsub|masked_fill_?|"
                                      r"dropout|native_dropout|where|tanh|exp|neg|pow|sqrt|rsqrt|sigmoid|relu|clamp|"
                                      r"lerp_?|addcmul_?|addcdiv_?|scale|_?softplus)(_backward)?$|^(Gelu|Add|Mul|Div|"
                                      r"Sub|Rsub|MaskedFill|NativeDropout|Where|Tanh|Exp|Neg|Pow|Sqrt|Rsqrt)$",
                                      re.I)),
)
_SYNC = re.compile(r"^(gloo:|c10d::|_c10d_functional::|nccl:|mpi:|ccl:|record_param_comms)|allreduce|all_reduce|"
                   r"reduce_scatter|all_gather", re.I)  # not "broadcast": aten::broadcast_tensors is no collective


def region_of(name: str) -> str | None:
    """The region an event opens (everything inside belongs to it unless a nearer region opens), or None."""
    if name in (MARK, BACKWARD):
        return "closure"
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return "optimizer step"
    if name.startswith("enumerate(DataLoader)"):
        return "data loading"
    if _SYNC.search(name):
        return "gradient sync"
    return None


def op_category(name: str) -> str | None:
    base = _NODE.match(name).group(2)
    for cat, pattern in _OPS:
        if pattern.search(base):
            return cat
    return None


def categorize(event: Any) -> str | None:
    """The row an event's self time goes to (None: not attributed, it is overhead); see the module docstring."""
    op, node = None, event
    while node is not None:
        region = region_of(node.name)
        if region == "closure":
            break
        if region is not None:
            return region
        op = op or op_category(node.name)
        node = node.cpu_parent
    if op is not None:
        return op
    # an op that matches no category; a Python scope's own time (the closure marker, DistributedDataParallel.forward,
    # Lightning's wrappers) is overhead
    return "other ops" if "::" in event.name or _NODE.match(event.name).group(3) else None


def _in_kernel(event: Any) -> bool:
    """Inside a fused or foreach AdamW kernel (their per-tensor fallbacks included; a for-loop AdamW has none)."""
    while event is not None and not event.name.startswith("Optimizer.step#"):
        if event.name.startswith(("aten::_fused_adam", "aten::_foreach_")):
            return True
        event = event.cpu_parent
    return False


def breakdown(events: Any, window_s: float, world: int = 1) -> tuple[dict[str, float], dict[str, Any]]:
    """Seconds per row over the window, and the details (top ops, other threads, AdamW kernels).

    With several ranks, the backward marker's own time counts as gradient sync: it is where DDP waits for the
    allreduce of the last buckets (the autograd engine's own part of it is a few ms per step on one rank)."""
    mains = {e.thread for e in events if e.name == MARK}
    main = max(mains, key=lambda t: sum(e.name == MARK for e in events if e.thread == t)) if mains else None
    rows: dict[str, float] = defaultdict(float)
    per_op: dict[tuple[str, str], float] = defaultdict(float)
    other_threads: dict[str, float] = defaultdict(float)
    closure_self = backward_self = adamw = 0.0
    for e in events:
        self_s = e.self_cpu_time_total / 1e6
        if e.thread != main:
            other_threads[e.name] += self_s
            continue
        cat = categorize(e)
        if cat is None:
            closure_self += self_s if e.name in (MARK, BACKWARD) else 0.0
            backward_self += self_s if e.name == BACKWARD else 0.0
            continue
        rows[cat] += self_s
        per_op[(e.name, cat)] += self_s
        if cat == "optimizer step" and _in_kernel(e):
            adamw += self_s
    if world > 1:
        rows["gradient sync"] += backward_self
    out = {r: rows.get(r, 0.0) for r in ROWS[:-1]}
    out[ROWS[-1]] = window_s - sum(out.values())
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:12]
    details = {"top_ops": [{"op": n, "row": c, "seconds": s} for (n, c), s in top], "adamw_kernels_s": adamw,
               "closure_overhead_s": closure_self, "backward_overhead_s": backward_self,
               "other_threads": dict(sorted(other_threads.items(), key=lambda kv: -kv[1])[:5])}
    return out, details


def matmul_peak(dtype: str, seconds: float, sizes: tuple[int, ...] = (512, 1024, 2048)) -> float:
    """FLOP/s of the matmul peak in ``dtype`` on every core this process may use: bench_vs_lightning's measurement
    (``measure_matmul_peak``, the best square matmul of ``sizes``), for the compute dtype only (an emulated bf16 peak
    takes seconds to measure and is not needed on a CPU that computes in fp32)."""
    import torch

    from lightning_horizon.callbacks import measure_matmul_peak
    from lightning_horizon.cpu import isa

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    if dtype == "bf16":
        return measure_matmul_peak(torch.bfloat16, sizes if isa().native_bf16 else sizes[:1], seconds)
    return measure_matmul_peak(torch.float32, sizes, seconds=seconds)


#: --gemms: the weight matmuls of one nn.Linear, as autograd computes them for (tokens, in) inputs
GEMMS = ("forward", "input grad", "weight grad")


def weight_gemms(model: Any, tokens: int, dtype: str, reps: int = 5) -> list[dict[str, Any]]:
    """The weight matmuls of ``model``'s ``nn.Linear`` layers, timed alone at their shapes in ``dtype``.

    For each distinct ``(in, out)`` shape, with ``tokens`` rows: the forward ``x @ W^T``, the input gradient
    ``dy @ W`` and the weight gradient ``dy^T @ x`` (the operand layouts autograd passes to ``mm``), each the fastest
    of ``reps`` calls (as the matmul peak is measured), times the layers of that shape: the best rate the step's
    weight matmuls reach at these shapes, whatever the rest of the step costs."""
    import torch

    from lightning_horizon.callbacks import fastest_call

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    shapes: dict[tuple[int, int], int] = defaultdict(int)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shapes[(m.in_features, m.out_features)] += 1
    rows = []
    for (k, n), layers in shapes.items():
        x, w, dy = (torch.randn(*s).to(dt) for s in ((tokens, k), (n, k), (tokens, n)))
        calls = {"forward": lambda: torch.mm(x, w.t()), "input grad": lambda: torch.mm(dy, w),
                 "weight grad": lambda: torch.mm(dy.t(), x)}
        rows += [{"in": k, "out": n, "layers": layers, "gemm": gemm, "seconds": fastest_call(calls[gemm], reps),
                  "flops": 2 * tokens * k * n} for gemm in GEMMS]
    return rows


def print_gemms(model: Any, tokens: int, dtype: str, threads: int, peak: float, world: int) -> dict[str, Any]:
    """``weight_gemms`` on ``threads`` threads, printed: GFLOP/s per shape and GEMM, and their share of the peak."""
    import torch

    from lightning_horizon.cpu import set_threads

    before = torch.get_num_threads()
    set_threads(threads)  # only where the count changes: a needless call slows the GEMMs timed next
    try:
        rows = weight_gemms(model, tokens, dtype)
    finally:
        set_threads(before)
    seconds = sum(r["seconds"] * r["layers"] for r in rows)
    rate = sum(r["flops"] * r["layers"] for r in rows) / seconds
    share = rate * world / peak  # every rank runs its own GEMMs at this rate
    print(f"weight GEMMs alone ({dtype}, {threads} thread(s), {tokens:,} tokens per rank): {1e3 * seconds:.1f} ms per"
          f" step, {rate / 1e9:.1f} GFLOP/s per rank = {100 * share:.1f}% of the peak")
    print(f"| {'in x out':<12} | layers | " + " | ".join(f"{g} GFLOP/s" for g in GEMMS) + " |")
    print("|" + "|".join("-" * w for w in (14, 8, *(len(g) + 10 for g in GEMMS))) + "|")
    for i in range(0, len(rows), len(GEMMS)):
        shape = rows[i: i + len(GEMMS)]
        print(f"| {shape[0]['in']:>5} x {shape[0]['out']:<4} | {shape[0]['layers']:>6} | " + " | ".join(
            f"{r['flops'] / r['seconds'] / 1e9:>{len(r['gemm']) + 8}.1f}" for r in shape) + " |")
    return {"gemms": rows, "gemms_share_of_peak": share}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    from gpt import ATTENTIONS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(HERE / "configs" / "small.yaml"), help="a recipe config (model + data)")
    p.add_argument("--steps", type=int, default=10, help="profiled steps")
    p.add_argument("--warmup", type=int, default=5, help="unprofiled steps first (the later half timed)")
    p.add_argument("--devices", type=int, default=1, help="ranks (Lightning's launcher starts the others)")
    p.add_argument("--threads-per-rank", type=int, default=None, help="intra-op threads per rank (default: the"
                   " strategy's policy, one per pinned core)")
    p.add_argument("--bucket-mb", type=float, default=None, help="DDP bucket size, MiB (default: the strategy's)")
    p.add_argument("--optimizer-impl", default=None, choices=("fused", "foreach", "for-loop"))
    p.add_argument("--attention", default=None, choices=ATTENTIONS)
    p.add_argument("--peak-seconds", type=float, default=1.0, help="time per dtype for the matmul-peak measurement")
    p.add_argument("--cache-dir", default=None, help="token cache (default ~/.cache/lightning_horizon)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--trace", default=None, help="also write a Chrome trace (chrome://tracing, ui.perfetto.dev)")
    p.add_argument("--gemms", action="store_true", help="after training, time the model's weight matmuls alone at"
                   " their shapes (forward, input and weight gradients): the rate they reach")
    p.add_argument("--smoke", action="store_true", help="tiny defaults: " + ", ".join(f"{k}={v}" for k, v in
                                                                                   SMOKE.items()))
    p.set_defaults(peak_sizes=(512, 1024, 2048))
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE)  # explicit options still win
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 2 or args.devices < 1:
        raise ValueError(f"--steps={args.steps} --warmup={args.warmup} --devices={args.devices}: need steps >= 1,"
                         " warmup >= 2 (the first steps build buffers and DDP's buckets), devices >= 1")

    import lightning as L
    import torch
    import yaml
    from lightning.pytorch.callbacks import Callback
    from torch.profiler import ProfilerActivity, profile, record_function

    from gpt import train_flops_per_token
    from lightning_horizon import GradNormBackoff, HorizonStrategy
    from lightning_horizon.cpu import machine_busy_seconds
    from lightning_horizon.precision import HorizonPrecision
    from lm_data import ByteCorpusDataModule
    from pretrain_gpt import GPTPretrain

    cfg = yaml.safe_load(Path(args.config).read_text())
    model_kw = dict(cfg.get("model", {}))
    model_kw.update({k: v for k, v in (("optimizer_impl", args.optimizer_impl), ("attention", args.attention)) if v})
    data_kw = dict(cfg.get("data", {}))
    batch, seq = data_kw.get("batch_size", 16), data_kw.get("seq_len", 256)
    if batch % args.devices:
        raise ValueError(f"--devices={args.devices}: the global batch {batch} ({args.config}) does not split")
    data_kw["batch_size"] = batch // args.devices
    if args.cache_dir:
        data_kw["cache_dir"] = args.cache_dir
    strategy_kw = {k: v for k, v in (("threads_per_rank", args.threads_per_rank), ("bucket_size_mb", args.bucket_mb))
                   if v is not None}
    precision = HorizonPrecision("auto")
    machine_cores = len(os.sched_getaffinity(0))  # before the strategy pins this process
    # a rank other than global rank 0 (the one that prints): Lightning's launcher starts ranks 1.. with LOCAL_RANK,
    # torchrun every rank with LOCAL_RANK and GROUP_RANK / NODE_RANK (rank 0 has 0 in each)
    printing = all(os.environ.get(v, "0") == "0" for v in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK"))
    peak = matmul_peak(precision.compute, args.peak_seconds, args.peak_sizes) if printing else None

    class Closure(GPTPretrain):  # the recipe's module, its closure marked
        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            def marked() -> Any:
                with record_function(MARK):
                    return optimizer_closure()

            super().optimizer_step(epoch, batch_idx, optimizer, marked)

        def backward(self, loss: Any, *args: Any, **kwargs: Any) -> None:
            with record_function(BACKWARD):
                super().backward(loss, *args, **kwargs)

    class Profiler(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.prof: Any = None
            self.window: tuple[float, float] = (0.0, 0.0)
            self.marks: list[tuple[float, float, float]] = []  # (wall, machine busy CPU s, own CPU s)
            self.foreign: list[float] = []  # others' share of the machine: unprofiled steps, profiled window
            self.cpu: list[float] = []  # every rank's CPU seconds: unprofiled steps, profiled window
            self.threads = 0

        def _mark(self) -> None:
            self.marks.append((time.perf_counter(), machine_busy_seconds(), time.process_time()))

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            import torch

            self.threads = torch.get_num_threads()  # while training (the strategy restores them at teardown)
            n = len(self.ends) + 1
            if n == args.warmup + args.steps:  # the window ends here
                self.window = (self.window[0], time.perf_counter())
                self._mark()
                if self.prof is not None:
                    self.prof.stop()
            self.ends.append(time.perf_counter())
            if n == (args.warmup - 1) // 2 + 1:  # the timed, unprofiled steps start here
                self._mark()
            if n == args.warmup:  # the window starts here
                self._mark()
                if trainer.global_rank == 0:
                    self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=False)
                    self.prof.start()
                self.window = (time.perf_counter(), 0.0)

        def on_train_end(self, trainer: Any, *_: Any) -> None:
            import torch

            (w0, b0, c0), (w1, b1, c1), (w2, b2, c2) = self.marks
            own = trainer.strategy.reduce(torch.tensor([c1 - c0, c2 - c1], dtype=torch.float64), reduce_op="sum")
            self.cpu = [float(own[0]), float(own[1])]
            self.foreign = [max(0.0, (b - float(o)) / (w * machine_cores)) for b, o, w in
                            ((b1 - b0, own[0], w1 - w0), (b2 - b1, own[1], w2 - w1))]

    L.seed_everything(1337, verbose=False)
    prof_cb = Profiler()
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=args.warmup + args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, strategy=HorizonStrategy(**strategy_kw), plugins=[precision],
        callbacks=[GradNormBackoff(max_norm=1.0), prof_cb],
    )
    module = Closure(**model_kw)
    trainer.fit(module, ByteCorpusDataModule(**data_kw))
    threads = prof_cb.threads
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # gloo at interpreter exit can abort (DESIGN.md)
    if trainer.global_rank != 0:
        return None

    window = prof_cb.window[1] - prof_cb.window[0]
    events = prof_cb.prof.events()
    rows, details = breakdown(events, window, trainer.world_size)
    if args.trace:
        prof_cb.prof.export_chrome_trace(args.trace)
    ends = prof_cb.ends
    diffs = [b - a for a, b in zip(ends[: args.warmup - 1], ends[1: args.warmup])]
    warm = diffs[len(diffs) // 2:]  # the later half of the warm-up: past the first steps' one-off costs
    step_unprof = statistics.median(warm)
    step_prof = window / args.steps
    tokens = batch * seq
    fpt = train_flops_per_token(module.cfg, seq)
    mfu = tokens / step_unprof * fpt / peak
    from lightning_horizon.cpu import isa

    attention = module.hparams.attention
    if attention == "auto":  # what "auto" took for this dtype and length (GPTConfig.attention)
        dtype = torch.bfloat16 if precision.compute == "bf16" else torch.float32
        attention = f"auto -> {module.model.blocks[0].attn.kind(seq, dtype)}"
    head = (f"profile_step: {args.config} | global batch {batch} x {seq} tokens | {args.devices} rank(s) x {threads}"
            f" thread(s) | compute {precision.compute} | optimizer {module.hparams.optimizer_impl} | attention"
            f" {attention} | ISA {isa().description} | {args.warmup} warm-up + {args.steps} profiled")
    print(head)
    print(f"step: {1e3 * step_unprof:.1f} ms unprofiled (median of {len(warm)}), {1e3 * step_prof:.1f} ms profiled"
          f" ({step_prof / step_unprof:.2f}x) | {tokens / step_unprof:,.0f} tokens/s | {fpt / 1e6:.1f} MFLOP/token |"
          f" {precision.compute} matmul peak {peak / 1e9:.1f} GFLOP/s | MFU {100 * mfu:.1f}%")
    cpu_step = prof_cb.cpu[0] / len(warm)  # the work, less sensitive than wall time to others' load on 1 thread
    print(f"others' load: {100 * prof_cb.foreign[0]:.0f}% of the machine during the unprofiled steps,"
          f" {100 * prof_cb.foreign[1]:.0f}% during the profiled ones | CPU time of all ranks {1e3 * cpu_step:.0f}"
          " ms per unprofiled step")
    print(f"| {'category (profiled, rank 0)':<28} | ms / step | share  |\n|{'-' * 30}|{'-' * 11}|{'-' * 8}|")
    for r in ROWS:
        print(f"| {r:<28} | {1e3 * rows[r] / args.steps:>9.2f} | {100 * rows[r] / window:>5.1f}% |")
    print(f"| {'total (window / steps)':<28} | {1e3 * step_prof:>9.2f} | {100 * sum(rows.values()) / window:>5.1f}% |")
    per = {k: 1e3 * details[k] / args.steps for k in ("adamw_kernels_s", "closure_overhead_s", "backward_overhead_s")}
    print(f"of which: AdamW kernels {per['adamw_kernels_s']:.2f} ms/step (optimizer step); in forward + backward"
          f" outside any op {per['closure_overhead_s']:.2f} ms/step, {per['backward_overhead_s']:.2f} of them in"
          " backward (" + ("waiting for the last buckets' allreduce: gradient sync)" if trainer.world_size > 1 else
                           "the autograd engine: overhead)"))
    print("top ops by self time:")
    for t in details["top_ops"]:
        print(f"  {1e3 * t['seconds'] / args.steps:8.2f} ms  {t['row']:<24} {t['op'][:90]}")
    if details["other_threads"]:
        print("other threads (not in the table): " + ", ".join(
            f"{n[:40]} {1e3 * s / args.steps:.2f} ms" for n, s in details["other_threads"].items()))
    gemms = print_gemms(module.model, batch // args.devices * seq, precision.compute, threads, peak,
                        trainer.world_size) if args.gemms else {}
    result = {"config": args.config, "devices": args.devices, "threads": threads, "compute": precision.compute,
              "optimizer_impl": module.hparams.optimizer_impl, "attention": attention,
              "step_unprofiled_s": step_unprof, "step_profiled_s": step_prof, "tokens_per_sec": tokens / step_unprof,
              "flops_per_token": fpt, "peak_flops": peak, "mfu": mfu, "foreign": prof_cb.foreign,
              "cpu_per_step_s": cpu_step,
              "rows_ms_per_step": {r: 1e3 * rows[r] / args.steps for r in ROWS},
              "rows_share": {r: rows[r] / window for r in ROWS}, **gemms, **details}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
