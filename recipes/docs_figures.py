"""Draw the figures of docs/ (PNG, about 100 dpi).

    python recipes/docs_figures.py --out docs            # every figure, the sharding plan on the docs' model
    python recipes/docs_figures.py --out /tmp/f --fast   # the same figures, the plan on a smaller model (seconds)

Figures:
  layout_16core.png         tokens/s and peak memory per layout, the measured table of docs/layout.md
  sharding_plan.png         the graph sharder's own plan on a small GPT: estimated peak per shard against the budget
  allreduce_topology.png    who sends to whom: flat ring against hierarchical (2 nodes x 4 ranks)
  node_sharded_state.png    node-sharded state: one shared weight copy, each rank owning its buckets' state
  store_streaming.png       the out-of-core store: layer reads and writes against compute, over one step
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

DPI = 100
BLUE, ORANGE, GREEN, GREY, RED = "#3b75af", "#ef8636", "#519e3e", "#8c8c8c", "#c53a32"


def _save(fig, out: Path, name: str) -> Path:
    path = out / name
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def layout_16core(out: Path) -> Path:
    """docs/layout.md, "Measured on a 16-core Xeon": `python recipes/bench_node.py --out runs/node --budget 500`,
    Intel Xeon (Emerald Rapids, family 6 model 207), 16 cores, AMX-BF16, torch 2.11.0, small GPT, 64 x 256 tokens."""
    tuner = {"1 x 16": (21034, 3190), "2 x 8": (23025, 2313), "4 x 4": (24077, 1775)}
    bench = {"1 x 16": (17389, 17231), "4 x 4": (21082, 21495), "16 x 1": (19427, 20808)}
    fig, (a, b) = plt.subplots(1, 2, figsize=(9.5, 3.4))
    names = list(tuner)
    a.bar(names, [tuner[n][0] for n in names], color=[GREY, GREY, BLUE])
    for i, n in enumerate(names):
        a.text(i, tuner[n][0] + 300, f"{tuner[n][0]:,}\n{tuner[n][1]:,} MiB/rank", ha="center", fontsize=8)
    a.set_ylim(0, 28000)
    a.set_title("the tuner: tokens/s (peak RSS per rank)", fontsize=10)
    a.set_xlabel("ranks x threads per rank")
    a.set_ylabel("tokens/s")
    names = list(bench)
    x = range(len(names))
    b.bar([i - 0.2 for i in x], [bench[n][0] for n in names], 0.4, color=GREY, label="Lightning bf16-mixed")
    b.bar([i + 0.2 for i in x], [bench[n][1] for n in names], 0.4, color=BLUE, label="horizon defaults")
    b.set_xticks(list(x), names)
    b.set_ylim(0, 28000)
    b.set_xlabel("ranks x threads per rank")
    b.set_title("the benchmark, one round per arm: tokens/s", fontsize=10)
    b.legend(fontsize=8, loc="upper left")
    fig.suptitle("Small GPT, 64 x 256 tokens per step, on a 16-core Intel Xeon (Emerald Rapids, AMX)", fontsize=10)
    fig.tight_layout()
    return _save(fig, out, "layout_16core.png")


def sharding_plan(out: Path, fast: bool) -> Path:
    """The sharder's plan (lightning_horizon.sharding) for the recipe GPT at three budgets."""
    import torch

    from lightning_horizon.sharding.plan import make_plan
    from lightning_horizon.sharding.profile import profile_step
    from pretrain_gpt import GPTPretrain

    n_layer, n_embd, block, batch = (2, 64, 64, 4) if fast else (4, 128, 128, 8)
    torch.manual_seed(0)
    model = GPTPretrain(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=block)
    x = torch.randint(0, 256, (batch, block + 1))
    prof = profile_step(model, (x[:, :-1], x[:, 1:]), 0, mode="fake")
    fixed = prof.param_bytes * 4  # weights, gradients and Adam's two moments, fp32
    whole = make_plan(prof, int((fixed + 1.3 * prof.total_saved) / 0.95), fixed)
    tight = make_plan(prof, int(fixed + 0.5 * prof.total_saved), fixed, best_effort=True)
    floor_budget = int(max(tight.floor, tight.estimated_peak) / 0.95) + 1
    plans = [("room to spare", whole.budget, whole),
             ("budget: fixed + 70% of activations", int(fixed + 0.7 * prof.total_saved), None),
             ("the smallest budget that fits", floor_budget, None)]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4), sharey=True)
    mib = 2 ** 20
    for ax, (title, budget, plan) in zip(axes, plans):
        plan = plan or make_plan(prof, budget, fixed, best_effort=True)
        peaks = [s.peak / mib for s in plan.shards]
        colors = [ORANGE if s.mode == "recompute" else BLUE for s in plan.shards]
        ax.bar(range(len(peaks)), peaks, color=colors, width=0.8)
        ax.axhline(budget / mib, color=RED, lw=1.5)
        ax.text(len(peaks) - 0.5, budget / mib, " budget", color=RED, va="bottom", ha="right", fontsize=8)
        ax.axhline(fixed / mib, color=GREY, lw=1, ls="--")
        ax.text(-0.4, fixed / mib, "resident state", color="black", va="top", fontsize=7,
                bbox=dict(fc="white", ec="none", pad=0.5))
        ax.set_title(f"{title}\n{len(plan.recompute)} calls recomputed, peak {plan.estimated_peak / mib:.0f} MiB",
                     fontsize=9)
        ax.set_xlabel("shard, in forward order")
        ax.set_xticks([])
    axes[0].set_ylabel("estimated peak RSS in its backward (MiB)")
    from matplotlib.patches import Patch

    axes[0].legend(handles=[Patch(color=BLUE, label="activations stored"),
                            Patch(color=ORANGE, label="recomputed in backward")], fontsize=8, loc="lower right")
    fig.suptitle(f"The graph sharder's plan for a {n_layer}-layer GPT (n_embd {n_embd}, {batch} x {block} tokens), "
                 "from its own profile", fontsize=10)
    fig.tight_layout()
    return _save(fig, out, "sharding_plan.png")


def _box(ax, x, y, w, h, text, color, fontsize=8, alpha=0.25):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec=color, alpha=alpha))
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc="none", ec=color))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, a, b, color, rad=0.0, lw=1.4, style="-|>"):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=10, color=color, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=9, shrinkB=9))


def allreduce_topology(out: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.2))
    L = 4
    pos = {(n, r): (0.8 + 1.2 * r, 3.0 - 2.2 * n) for n in range(2) for r in range(L)}
    for ax, title in zip(axes, ("flat: one ring over all 8 ranks",
                                "hierarchical: inside the node, then across it, slice by slice")):
        ax.set_xlim(0, 5.6)
        ax.set_ylim(-0.2, 4.2)
        ax.axis("off")
        ax.set_title(title, fontsize=10)
        for n in range(2):
            _box(ax, 0.3, pos[(n, 0)][1] - 0.45, 4.8, 0.9, "", GREY, alpha=0.08)
            ax.text(5.15, pos[(n, 0)][1], f"node {n}", fontsize=9, va="center")
        for (n, r), (x, y) in pos.items():
            ax.add_patch(plt.Circle((x, y), 0.27, fc="white", ec=BLUE, lw=1.5))
            ax.text(x, y, f"{n * L + r}", ha="center", va="center", fontsize=9)
    a, b = axes
    ring = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 3), (1, 2), (1, 1), (1, 0)]
    for i, k in enumerate(ring):
        j = ring[(i + 1) % len(ring)]
        inter = k[0] != j[0]
        _arrow(a, pos[k], pos[j], RED if inter else BLUE, rad=0.0 if not inter else (-0.3 if i == 3 else -0.3),
               lw=2.2 if inter else 1.4)
    a.text(2.7, -0.1, "2(P-1) steps, each waits for the 2 inter-node hops (red)", ha="center", fontsize=8)
    for n in range(2):
        for r in range(L - 1):
            _arrow(b, pos[(n, r)], pos[(n, r + 1)], BLUE, rad=0.35)
            _arrow(b, pos[(n, r + 1)], pos[(n, r)], BLUE, rad=0.35)
    for r in range(L):
        _arrow(b, pos[(0, r)], pos[(1, r)], RED, rad=0.12, lw=2.2)
        _arrow(b, pos[(1, r)], pos[(0, r)], RED, rad=0.12, lw=2.2)
    b.text(2.7, -0.1, "1. reduce-scatter in the node (blue)   2. each local rank allreduces its 1/L slice\n"
           "across nodes, all L at once (red)   3. all-gather in the node (blue)", ha="center", fontsize=8)
    fig.tight_layout()
    return _save(fig, out, "allreduce_topology.png")


def node_sharded_state(out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9.5, 4.4))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 5.4)
    ax.axis("off")
    _box(ax, 0.3, 0.2, 9.4, 5.0, "", GREY, alpha=0.06)
    ax.text(0.5, 4.95, "one node, 4 ranks", fontsize=9, va="center")
    buckets = ["bucket 0\n(lm head, ln_f)", "bucket 1\n(blocks 3, 2)", "bucket 2\n(blocks 1, 0)", "bucket 3\n(embeddings)"]
    _box(ax, 0.8, 3.6, 8.4, 1.0, "", BLUE, alpha=0.15)
    ax.text(5.0, 4.42, "the weights: one copy in /dev/shm, mapped by every rank (each forward reads all of it)",
            ha="center", fontsize=8)
    for i, name in enumerate(buckets):
        _box(ax, 1.0 + 2.05 * i, 3.72, 1.85, 0.5, name.replace("\n", " "), BLUE, fontsize=7, alpha=0.25)
    colors = [ORANGE, GREEN, "#9b59b6", RED]
    for r in range(4):
        x = 1.0 + 2.05 * r
        _box(ax, x, 0.5, 1.85, 1.9, f"rank {r}\nowns bucket {r}:\n\nfp32 master\nits gradient\noptimizer state",
             colors[r], fontsize=8, alpha=0.2)
        _arrow(ax, (x + 0.92, 2.4), (x + 0.92, 3.72), colors[r], lw=1.6)
    ax.text(5.0, 2.95, "each owner's optimizer step writes its bucket of the shared weights in place",
            ha="center", fontsize=8, bbox=dict(fc="white", ec="none"))
    ax.text(5.0, 0.28, "backward: the other ranks' gradients of a bucket are summed on its owner "
            "(state per node: 1/4 of replicated)", ha="center", fontsize=8)
    return _save(fig, out, "node_sharded_state.png")


def store_streaming(out: Path) -> Path:
    """A schematic of one step with the store, 4 layers, prefetch="read", step="in_backward"."""
    fig, ax = plt.subplots(figsize=(10, 3.0))
    n, t, lanes = 4, 1.0, {"compute": 2.0, "disk reads": 1.0, "disk writes": 0.0}
    y = {k: v for k, v in lanes.items()}
    clock = 0.0
    for i in range(n):  # forward: layer i computes while layer i+1 is read
        if i == 0:
            ax.broken_barh([(clock - 0.7, 0.6)], (y["disk reads"] - 0.3, 0.6), fc=BLUE, alpha=0.6)
            ax.text(clock - 0.4, y["disk reads"], "W0", ha="center", va="center", fontsize=7, color="white")
        ax.broken_barh([(clock, t)], (y["compute"] - 0.3, 0.6), fc=GREEN, alpha=0.8)
        ax.text(clock + t / 2, y["compute"], f"fwd {i}", ha="center", va="center", fontsize=7, color="white")
        if i + 1 < n:
            ax.broken_barh([(clock + 0.05, 0.6)], (y["disk reads"] - 0.3, 0.6), fc=BLUE, alpha=0.6)
            ax.text(clock + 0.35, y["disk reads"], f"W{i + 1}", ha="center", va="center", fontsize=7, color="white")
        clock += t
    for i in reversed(range(n)):  # backward: layer i, then its optimizer step, its state written back behind it
        ax.broken_barh([(clock, 1.4 * t)], (y["compute"] - 0.3, 0.6), fc=ORANGE, alpha=0.85)
        ax.text(clock + 0.7 * t, y["compute"], f"bwd {i} + step", ha="center", va="center", fontsize=7, color="white")
        if i > 0:
            ax.broken_barh([(clock, 0.8)], (y["disk reads"] - 0.3, 0.6), fc=BLUE, alpha=0.6)
            ax.text(clock + 0.4, y["disk reads"], f"W,S{i - 1}", ha="center", va="center", fontsize=7, color="white")
        ax.broken_barh([(clock + 1.4 * t, 0.9)], (y["disk writes"] - 0.3, 0.6), fc=GREY, alpha=0.8)
        ax.text(clock + 1.4 * t + 0.45, y["disk writes"], f"W,S{i}", ha="center", va="center", fontsize=7,
                color="white")
        clock += 1.4 * t
    ax.set_yticks(list(y.values()), list(y.keys()))
    ax.set_xlabel("time in one step (schematic)")
    ax.set_xticks([])
    ax.set_xlim(-0.8, clock + 1.1)
    ax.set_ylim(-0.6, 2.6)
    ax.set_title("The out-of-core store: the next layer's weights (W) and state (S) read ahead while a layer "
                 "computes;\neach layer's optimizer step inside backward, its new state written back behind it",
                 fontsize=9)
    for s in ("top", "right"):
        ax.spines[s].set_visible(False)
    fig.tight_layout()
    return _save(fig, out, "store_streaming.png")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs", help="folder for the PNG files (created)")
    p.add_argument("--fast", action="store_true", help="the sharding plan on a smaller model (for the smoke test)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for path in (layout_16core(out), sharding_plan(out, args.fast), allreduce_topology(out),
                 node_sharded_state(out), store_streaming(out)):
        print(f"{path} {path.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
