"""Raw torch DDP on gloo, 4 ranks = 2 emulated nodes x 2, checking every comm hook against DDP's own allreduce.

Run by tests/test_collectives.py as a world of 4 ranks forked from one launch (tests/launch.run_worlds: hard
timeout, process-group kill), each rank calling ``main(OUT.json)`` with the variables a launcher gives its ranks
(LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Rank 0 writes one JSON file of named checks ``{name: {"ok": bool,
"detail": str}}``; each pytest test asserts one of them.
"""

from __future__ import annotations

import json
import os
import time
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_horizon.collectives import CollectivesConfig, CostModel, GradientSync
from lightning_horizon.topology import ProcessGroups, Topology
from lightning_horizon.state import TrainingState

WORLD, PER_NODE = 4, 2
ITERS = 40  # parity iterations (DDP rebuilds its buckets after the first)
SHORT_ITERS = 30  # the other variants (compressed, chunked, odd buckets)
TRAIN_STEPS = 50  # loss-trajectory steps
TRAJECTORY_RTOL = 1e-4  # hierarchical / torus2d sum in another order: rounding only, over 50 Adam steps
COMPRESSED_STEPS = 100
COMPRESSED_RTOL = 0.01  # final loss of int8 / bf16 with error feedback vs uncompressed, relative
WIDTH = 32
EQUAL_BUCKET_MB = (WIDTH * WIDTH + WIDTH) * 4 / 2**20  # one Linear(32, 32) per bucket: 4 equal buckets
ODD_BUCKET_MB = 416 * 4 / 2**20  # DDP closes a bucket once it holds >= the cap
CHUNK_MB = 300 * 4 / 2**20  # pipeline chunks of 300 elements: several per bucket, the last one shorter
BF16_NUMEL = 64  # bf16 gradients, one parameter of 64 per bucket after the rebuild
FAULT_AT, FAULT_STEPS = 3, 8  # the step whose gradient turns non-finite on rank 1, of 8
# Link constants for `auto` under which buckets above about 1000 elements go flat, smaller ones hierarchical.
AUTO_COSTS = {"intra": (1e-6, 1e-9), "inter": (1e-6, 1e-9)}


def equal_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(4)])


def odd_model() -> torch.nn.Module:
    """Two buckets (416 and 3135 elements after the rebuild, with ODD_BUCKET_MB) that need padding; `auto` takes
    a different algorithm for each."""
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 95), torch.nn.Tanh(), torch.nn.Linear(95, 3), torch.nn.Tanh(), torch.nn.Linear(3, WIDTH)
    )


def batch(it: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * it + rank)
    x = torch.randn(16, WIDTH, generator=g)
    return x, torch.sin(x.roll(1, dims=1))


def wrap(model: torch.nn.Module, groups: ProcessGroups, bucket_mb: float, **cfg) -> tuple[DDP, GradientSync | None]:
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    if not cfg:
        return ddp, None
    sync = GradientSync.with_links(CollectivesConfig(**cfg), groups, model, TrainingState())
    ddp.register_comm_hook(sync, sync.hook)
    return ddp, sync


def grads(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


def all_ranks(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t)
    return out


def same_on_all_ranks(t: torch.Tensor) -> bool:
    out = all_ranks(t)
    return all(torch.equal(out[0], o) for o in out)


def mean_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / WORLD).tolist()


def check_parity(checks: dict, groups: ProcessGroups, factory, bucket_mb: float, variants: dict, tag: str,
                 long: tuple[str, ...] = ()) -> dict:
    """Every variant computes gradients at the reference's parameters, the ``long`` ones for ITERS iterations,
    the others for the first SHORT_ITERS (the bucket rebuild falls in them); compare each with the reference."""
    ref, _ = wrap(factory(), groups, bucket_mb)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    runs = {name: wrap(factory(), groups, bucket_mb, **cfg) for name, cfg in variants.items()}
    sizes = {name: record_bucket_sizes(sync) for name, (_, sync) in runs.items()}
    worst = {name: 0.0 for name in runs}
    history: dict[str, list[torch.Tensor]] = {name: [] for name in runs}  # every iteration's gradients
    iters = {name: ITERS if name in long else SHORT_ITERS for name in variants}
    ef_sums = {name: torch.zeros_like(grads_like(ref)) for name in runs}  # applied gradients, summed
    ref_sums = {name: torch.zeros_like(grads_like(ref)) for name in runs}  # true gradients over the same iterations
    step_bytes: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for it in range(ITERS):
        x, y = batch(it, dist.get_rank())
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        g_ref = grads(ref.module)
        for name, (ddp, sync) in runs.items():
            if it >= iters[name]:
                continue
            ref_sums[name] += g_ref
            with torch.no_grad():
                for p, q in zip(ddp.module.parameters(), ref.module.parameters()):
                    p.copy_(q)
                    p.grad = None
            sizes[name].clear()  # keep the last iteration's bucket sizes
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            g = grads(ddp.module)
            ef_sums[name] += g
            sync.after_optimizer_step()
            step_bytes[name].append((sync.accounting.last_step.intra_bytes, sync.accounting.last_step.inter_bytes))
            if variants[name].get("compression") is None:
                worst[name] = max(worst[name], rel_excess(g, g_ref))
            history[name].append(g)
        opt.step()
    for name, (ddp, sync) in runs.items():
        cfg = variants[name]
        if cfg.get("compression") is None:
            checks[f"parity_{tag}_{name}"] = result(
                worst[name] <= 1.0,
                f"max |g-g_ref| / (1e-6 |g_ref| + atol) = {worst[name]:.3f} over {iters[name]} iterations",
            )
        else:
            # Error feedback: sum of applied gradients + (sum over ranks of the residual) / P == sum of true ones.
            err, residual_max, detail = ef_identity(sync, ddp, ef_sums[name], ref_sums[name])
            checks[f"error_feedback_{tag}_{name}"] = result(
                err < 1e-5 and residual_max > 0, f"{iters[name]} iterations: {detail}")
        if cfg["collectives"] == "auto" and tag == "odd":
            chose = sync.planner.choices
            checks[f"auto_choices_{tag}"] = result({a for a, _, _ in chose.values()} == {"flat", "hierarchical"},
                                                   f"auto chose {chose}")
        checks[f"bitwise_{tag}_{name}"] = result(same_on_all_ranks(torch.stack(history[name])),
                                                  f"gradients bitwise equal on all ranks, all {iters[name]} iterations")
        checks[f"accounting_{tag}_{name}"] = check_bytes(sync, cfg, sizes[name], step_bytes[name])
    return checks


def ef_identity(sync: GradientSync, ddp: DDP, applied: torch.Tensor, true: torch.Tensor) -> tuple[float, float, str]:
    """Error feedback's telescoping identity: sum of applied gradients + (sum over ranks of the residual) / P ==
    sum of true ones. Returns its max relative error, the residual's max and a description."""
    residual = torch.cat([sync.error_feedback.residual.get(n, torch.zeros_like(p)).reshape(-1)
                          for n, p in ddp.module.named_parameters()])
    dist.all_reduce(residual)
    err = ((applied + residual / WORLD - true).abs().max() / true.abs().max()).item()
    drift = ((applied - true).abs().max() / true.abs().max()).item()
    residual_max = residual.abs().max().item()
    return err, residual_max, (f"telescoping identity max rel error {err:.2e} (without the residual {drift:.2e}),"
                               f" residual max {residual_max:.2e}")


def record_bucket_sizes(sync: GradientSync) -> list[int]:
    """Record the size of every bucket the hook reduces (instance attribute shadows the method)."""
    sizes: list[int] = []
    reduce = sync.reduce

    def recording(bucket):
        sizes.append(bucket.buffer().numel())
        return reduce(bucket)

    sync.reduce = recording
    return sizes


def grads_like(ddp: DDP) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])


def rel_excess(g: torch.Tensor, ref: torch.Tensor) -> float:
    """max over elements of |g - ref| / (rtol |ref| + atol): <= 1 means allclose(rtol=1e-6, atol) holds.

    atol = 1e-6 * max|ref|: summing in another order differs by a few ulp of the *terms*, which near a
    cancelling sum is more than 1e-6 of the (small) sum itself.
    """
    atol = 1e-6 * ref.abs().max().item()
    return ((g - ref).abs() / (1e-6 * ref.abs() + atol)).max().item()


def check_bytes(sync: GradientSync, cfg: dict, sizes: list[int], per_step: list[tuple[float, float]]) -> dict:
    """The accounting's bytes (mean over ranks, last step) vs the cost model's for that step's buckets."""
    model = CostModel.coerce(AUTO_COSTS)
    expect_intra = expect_inter = 0.0
    for numel in sizes:
        algorithm, chunk, compression = sync.planner.plan_for(numel)
        p = model.predict(algorithm, numel, WORLD // PER_NODE, PER_NODE, compression=compression,
                          torus_cols=sync.torus_cols, int8_block=sync.config.int8_block,
                          chunk_numel=chunk)
        expect_intra += p.intra_bytes
        expect_inter += p.inter_bytes
    got_intra, got_inter = mean_over_ranks(list(per_step[-1]))
    ok = abs(got_intra - expect_intra) <= 1e-9 * max(expect_intra, 1) and abs(got_inter - expect_inter) <= 1e-9 * max(
        expect_inter, 1
    )
    return result(ok, f"buckets {sizes}: accounted intra {got_intra:.0f} inter {got_inter:.0f} B/rank/step,"
                      f" model {expect_intra:.0f} / {expect_inter:.0f}")


def train(groups: ProcessGroups, cfg: dict, steps: int) -> list[float]:
    """Adam on the regression task; the per-step loss averaged over ranks."""
    ddp, sync = wrap(equal_model(), groups, EQUAL_BUCKET_MB, **cfg)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    losses = []
    for it in range(steps):
        x, y = batch(it, dist.get_rank())
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        if sync is not None:
            sync.after_optimizer_step()
        losses.append(loss.item())
    return mean_over_ranks(losses)


def check_training(checks: dict, groups: ProcessGroups) -> None:
    ref = train(groups, {}, COMPRESSED_STEPS)
    for name in ("hierarchical", "torus2d"):
        got = train(groups, {"collectives": name}, TRAIN_STEPS)
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref[:TRAIN_STEPS]))
        checks[f"trajectory_{name}"] = result(worst <= TRAJECTORY_RTOL, f"{TRAIN_STEPS} steps: max relative loss"
                                              f" difference to DDP {worst:.2e} (allowed {TRAJECTORY_RTOL:g})")
    final_ref = sum(ref[-10:]) / 10
    for name, cfg in {"hierarchical_int8": {"collectives": "hierarchical", "compression": "int8"},
                      "flat_bf16": {"collectives": "flat", "compression": "bf16"}}.items():
        got = train(groups, cfg, COMPRESSED_STEPS)
        final = sum(got[-10:]) / 10
        rel = abs(final - final_ref) / final_ref
        checks[f"compressed_training_{name}"] = result(
            rel <= COMPRESSED_RTOL, f"{COMPRESSED_STEPS} steps: final loss {final:.5f} vs uncompressed {final_ref:.5f}"
            f" (first {ref[0]:.4f}): relative difference {rel:.2e}, allowed {COMPRESSED_RTOL:g}")


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check_local_sgd(checks: dict, groups: ProcessGroups) -> None:
    """sync_every=4 after 3 warm-up steps: parameters equal inside a node always, across nodes after syncs, and a
    sync leaves every rank with the mean of the nodes' weights just before it (float64 mean, fp32 rounding)."""
    model = equal_model()
    ddp, sync = wrap(model, groups, EQUAL_BUCKET_MB, collectives="hierarchical", sync_every=4, sync_warmup_steps=3)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    within, across, inter_bytes, saved, mean_err, spread = [], [], [], None, {}, {}
    for it in range(15):
        x, y = batch(it, dist.get_rank())
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        before = all_ranks(flat_weights(model))  # the nodes' weights right before a (possible) average
        sync.after_optimizer_step()
        inter_bytes.append(mean_over_ranks([sync.accounting.last_step.inter_bytes])[0])
        out = all_ranks(flat_weights(model))
        within.append(torch.equal(out[0], out[1]) and torch.equal(out[2], out[3]))
        across.append(torch.equal(out[0], out[2]))
        if across[-1] and it + 1 > 3:  # an average: each rank holds the mean of node 0's and node 1's weights
            nodes = torch.stack([before[0], before[2]]).double()
            mean = nodes.mean(0)
            # the fp32 rounding bound: an ulp of the mean and one of the largest term (the fp32 sum's rounding)
            bound = 2.0**-23 * (mean.abs() + nodes.abs().amax(0)) + 1e-30
            mean_err[it + 1] = max(((o.double() - mean).abs() / bound).max().item() for o in out)
            spread[it + 1] = (nodes[0] - nodes[1]).abs().max().item()  # > 0: the nodes had drifted apart
        if it + 1 == 9:
            saved = sync.state_dict()
    expected = [s <= 3 or (s - 3) % 4 == 0 for s in range(1, 16)]  # warm-up steps, then every 4th
    checks["local_sgd_schedule"] = result(
        all(within) and across == expected and all((b > 0) == e for b, e in zip(inter_bytes, expected)),
        f"within-node equal {within}; across-node equal {across} (expected {expected}); inter bytes {inter_bytes}",
    )
    checks["local_sgd_mean"] = result(
        list(mean_err) == [7, 11, 15] and all(e <= 1.0 for e in mean_err.values())
        and all(s > 1e-4 for s in spread.values()),
        f"after the averages at steps {list(mean_err)} (expected [7, 11, 15]): max |w - float64 mean of the nodes'"
        f" weights before| / fp32 rounding bound {mean_err} (allowed 1); the nodes differed by up to {spread} before",
    )
    fresh = GradientSync(CollectivesConfig("hierarchical", sync_every=4, sync_warmup_steps=3), groups, equal_model(),
                         TrainingState())
    fresh.load_state_dict(saved)
    checks["local_sgd_state"] = result(
        {k: v for k, v in saved.items() if k != "layout"}  # the bucket layout: tests/test_reliability.py
        == {"algorithm": "hierarchical", "error_feedback": None, "periodic": {"step": 9, "syncs": 1}}
        and len(saved["layout"]) == 4
        and fresh.periodic.step == 9 and not fresh.periodic.global_gradients,
        f"saved {saved}, restored step {fresh.periodic.step}",
    )


def outer_state_restores(saved: dict, groups: ProcessGroups, overlap: bool, numel: int) -> bool:
    """The outer step's checkpoint at step 9 (mid-period; overlapped, the exchange in flight) holds this node's slice
    of the anchor, and the slices sent and the snapshot only when overlapped; a fresh sync takes it."""
    fresh = GradientSync(CollectivesConfig("hierarchical", sync_every=4, sync_warmup_steps=3, outer="nesterov",
                                           sync_overlap=overlap), groups, equal_model(), TrainingState())
    fresh.load_state_dict(saved)
    o = saved["periodic"]["outer"]
    return (saved["periodic"]["step"] == 9 and fresh.periodic.outer.anchor is o["anchor"]
            and (o["sent"] is not None) == overlap and (o["snapshot"] is not None) == overlap
            and o["anchor"].numel() == numel // PER_NODE)


def check_outer(checks: dict, groups: ProcessGroups) -> None:
    """DiLoCo's outer step (sync_every=4 after 3 warm-up steps, Nesterov lr 0.7 momentum 0.9), blocking and
    overlapped, against the algorithm written out in float64 on the nodes' weights just before each sync: the anchor
    taken where local training begins (after the warm-up), at every sync the nodes' average delta (anchor - weights)
    stepping the anchor; blocking, every rank continues from the new anchor; overlapped, the exchange sent at one
    sync is applied at the next, on top of what each node trained since. Ranks of a node stay bitwise equal, a
    checkpoint mid-period (the exchange in flight) holds the slices and the arrived sum."""
    lr, mu = 0.7, 0.9
    for overlap in (False, True):
        model = equal_model()
        ddp, sync = wrap(model, groups, EQUAL_BUCKET_MB, collectives="hierarchical", sync_every=4, sync_warmup_steps=3,
                         outer="nesterov", sync_overlap=overlap)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        anchor = velocity = None
        snapshot, sent = {}, None
        within, errors, saved, moved = [], {}, None, {}
        out = all_ranks(flat_weights(model))
        for it in range(15):
            step = it + 1
            if step == 4:  # the first local step: the anchor is the warm-up's weights, the same on every rank
                anchor, velocity = out[0].double(), torch.zeros_like(out[0], dtype=torch.float64)
            x, y = batch(it, dist.get_rank())
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            before = all_ranks(flat_weights(model))
            sync.after_optimizer_step()
            out = all_ranks(flat_weights(model))
            within.append(torch.equal(out[0], out[1]) and torch.equal(out[2], out[3]))
            if step > 3 and (step - 3) % 4 == 0:
                nodes = {n: before[2 * n].double() for n in (0, 1)}
                expect = dict(nodes)
                if not overlap or sent is not None:
                    mean = (anchor - (nodes[0] + nodes[1]) / 2) if not overlap else (sent[0] + sent[1]) / 2
                    velocity = mu * velocity + mean
                    anchor = anchor - lr * (mean + mu * velocity)
                    expect = {n: anchor if not overlap else anchor + (nodes[n] - snapshot[n]) for n in (0, 1)}
                if overlap:
                    snapshot = dict(expect)
                    sent = {n: anchor - expect[n] for n in (0, 1)}
                scale = max(float(v.abs().max()) for v in expect.values())
                errors[step] = max(float((out[2 * n].double() - expect[n]).abs().max()) / scale for n in (0, 1))
                moved[step] = float((out[0].double() - nodes[0]).abs().max())
            if step == 9:
                saved = sync.state_dict()
        tag = "outer_overlap" if overlap else "outer_nesterov"
        state_ok = outer_state_restores(saved, groups, overlap, flat_weights(model).numel())
        # the first overlapped sync sends only: the weights stay; every other sync moves them
        first_stays = moved[7] == 0.0 if overlap else moved[7] > 0
        checks[tag] = result(
            all(within) and list(errors) == [7, 11, 15] and all(e <= 1e-6 for e in errors.values()) and first_stays
            and all(moved[s] > 0 for s in (11, 15)) and state_ok,
            f"within-node equal {within}; max |w - float64 reference| / max |reference| at the syncs {errors} (allowed"
            f" 1e-6); largest move at each sync {moved}; checkpoint at step 9 {state_ok}",
        )


def check_outer_auto(checks: dict, groups: ProcessGroups) -> None:
    """sync_overlap="auto": overlapped where the given links make the exchange a real part of the period (a
    10 Mbit/s inter-node link: the weights' exchange takes ~30 ms against a few ms of compute), not where it is free
    (links of 1 PB/s); the same decision on every rank, kept in the checkpoint."""
    decided = {}
    for name, beta in (("slow", 1 / 1.25e6), ("free", 1e-15)):
        links = {"intra": (1e-9, 1e-15), "inter": (1e-9, beta)}
        ddp, sync = wrap(equal_model(), groups, EQUAL_BUCKET_MB, collectives="hierarchical", sync_every=2,
                         sync_overlap="auto", cost_model=links)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for it in range(2):
            x, y = batch(it, dist.get_rank())
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            sync.after_optimizer_step()
        outer = sync.periodic.outer
        decided[name] = [bool(v) for v in all_ranks(torch.tensor([float(outer.overlap)]))]
        decided[f"{name} saved"] = sync.state_dict()["periodic"]["outer"]["overlap"]
    checks["outer_auto"] = result(
        decided == {"slow": [True] * WORLD, "slow saved": True, "free": [False] * WORLD, "free saved": False},
        f"overlap decided per rank and saved: {decided}",
    )


class Values(torch.nn.Module):
    """Three bf16 parameters whose gradients are the input: the gradient of ``sum(p * c)`` is ``c``."""

    def __init__(self) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(BF16_NUMEL, dtype=torch.bfloat16)) for _ in range(3))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return sum((p.float() * ci).sum() for p, ci in zip(self.ps, c))


def check_bf16_sum(checks: dict, groups: ProcessGroups) -> None:
    """Uncompressed bf16 gradients (bf16-true weights) are summed in fp32 and rounded once, by every algorithm.

    Each rank's gradients are 1 + k/128 (exact in bf16): their fp32 sum is exact, while a bf16 sum rounds every
    partial sum of two or more to 2^-6. Iteration 0 runs in DDP's one first bucket, iteration 1 in three.
    """
    rank = dist.get_rank()
    variants = {"flat": {"collectives": "flat"}, "hierarchical": {"collectives": "hierarchical"},
                "torus2d": {"collectives": "torus2d"},
                "local_sgd": {"collectives": "hierarchical", "sync_every": 2}}  # reduced inside the node only
    for name, cfg in variants.items():
        ddp, sync = wrap(Values(), groups, BF16_NUMEL * 2 / 2**20, **cfg)
        members = groups.intra_ranks if cfg.get("sync_every") else list(range(WORLD))
        exact = rounds = agree = True
        for it in range(2):
            g = torch.Generator().manual_seed(it)
            values = 1 + torch.randint(0, 128, (WORLD, 3, BF16_NUMEL), generator=g) / 128
            for p in ddp.module.ps:
                p.grad = None
            ddp(values[rank]).backward()
            sync.after_optimizer_step()
            got = torch.stack([p.grad for p in ddp.module.ps])
            expect = (values[members].sum(0) / len(members)).to(torch.bfloat16)  # fp32 sum, rounded once
            naive = values[members[0]].to(torch.bfloat16)
            for r in members[1:]:
                naive = naive + values[r].to(torch.bfloat16)  # summed in bf16
            exact &= torch.equal(got, expect)
            rounds &= not torch.equal((naive / len(members)).to(torch.bfloat16), expect)
            agree &= same_on_all_ranks(got) or bool(cfg.get("sync_every"))
        checks[f"bf16_sum_{name}"] = result(
            exact and agree and (rounds or len(members) == 2),  # two members: a bf16 sum rounds once too
            f"equal to the fp32 sum rounded once: {exact}; a bf16 sum would differ: {rounds}; bitwise equal: {agree}")


def check_nonfinite(checks: dict, groups: ProcessGroups) -> None:
    """Rank 1's gradient turns non-finite at step FAULT_AT (NaN everywhere, or Inf in one element of the last
    bucket): every rank sees a non-finite step and skips it (as GradNormBackoff does), the error feedback keeps
    the residual of every non-finite bucket as it was, and the run goes on finite. With every bucket kept, the
    telescoping identity holds over the applied steps exactly as without the fault."""
    rank = dist.get_rank()
    faults = {"flat_int8": ({"collectives": "flat", "compression": "int8"}, "nan"),
              "hierarchical_int8": ({"collectives": "hierarchical", "compression": "int8"}, "inf"),
              "torus2d_bf16": ({"collectives": "torus2d", "compression": "bf16"}, "nan")}
    for name, (cfg, fault) in faults.items():
        ref, _ = wrap(equal_model(), groups, EQUAL_BUCKET_MB)  # plain DDP: the true mean gradient
        model = equal_model()
        ddp, sync = wrap(model, groups, EQUAL_BUCKET_MB, **cfg)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        applied, true = torch.zeros_like(grads_like(ref)), torch.zeros_like(grads_like(ref))
        skipped, kept = [], set()
        for it in range(FAULT_STEPS):
            x, y = batch(it, rank)
            with torch.no_grad():
                for p, q in zip(ref.parameters(), model.parameters()):
                    p.copy_(q)
                    p.grad = None
            torch.nn.functional.mse_loss(ref(x), y).backward()
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            if it == FAULT_AT and rank == 1:
                loss = loss * float("nan") if fault == "nan" else loss + model[3][0].weight[0, 0] * float("inf")
            before = {n: r.clone() for n, r in sync.error_feedback.residual.items()}
            loss.backward()
            g = grads(model)
            if torch.isfinite(g).all():
                opt.step()
                applied += g
                true += grads(ref.module)
            else:
                skipped.append(it)
                kept = {n for n, r in sync.error_feedback.residual.items() if torch.equal(r, before[n])}
            sync.after_optimizer_step()
        residual = sync.error_feedback.residual
        names = {n for n, _ in model.named_parameters()}
        expect_kept = names if fault == "nan" else {"3.0.weight", "3.0.bias"}
        err, _, detail = ef_identity(sync, ddp, applied, true)
        finite = all(torch.isfinite(t).all() for t in [*residual.values(), *model.parameters()])
        ok = (skipped == [FAULT_AT] and same_on_all_ranks(torch.tensor(skipped)) and kept == expect_kept
              and finite and set(residual) == names and (fault != "nan" or err < 1e-5))
        checks[f"nonfinite_{name}"] = result(
            ok, f"{fault} on rank 1 at step {FAULT_AT}: skipped {skipped}; residuals kept {sorted(kept)} (expected"
                f" {sorted(expect_kept)}); residuals and weights finite: {finite}; {detail}")


def result(ok: bool, detail: str) -> dict:
    return {"ok": bool(ok), "detail": detail}


def main(out_path: str) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    groups = ProcessGroups(Topology(world_size=WORLD, rank=rank, ranks_per_node=PER_NODE))
    checks: dict = {}
    try:
        uncompressed = {
            "flat": {"collectives": "flat"},
            "hierarchical": {"collectives": "hierarchical"},
            "torus2d": {"collectives": "torus2d"},
            "auto": {"collectives": "auto", "cost_model": AUTO_COSTS},
            # Pipelined in chunks of 300 elements: 1056 -> 300, 300, 300, 156.
            "hierarchical_chunked": {"collectives": "hierarchical", "pipeline_chunk_mb": CHUNK_MB},
        }
        compressed = {
            "flat_int8": {"collectives": "flat", "compression": "int8"},
            "hierarchical_int8": {"collectives": "hierarchical", "compression": "int8"},
            "torus2d_bf16": {"collectives": "torus2d", "compression": "bf16"},
            "hierarchical_int8_chunked": {"collectives": "hierarchical", "compression": "int8",
                                          "pipeline_chunk_mb": CHUNK_MB},
        }
        clock = Clock(rank)
        check_parity(checks, groups, equal_model, EQUAL_BUCKET_MB, {**uncompressed, **compressed}, "equal",
                     long=("flat", "hierarchical", "torus2d", "auto"))
        odd = {k: uncompressed[k] for k in ("hierarchical", "torus2d", "auto", "hierarchical_chunked")}
        odd["hierarchical_int8"] = compressed["hierarchical_int8"]
        clock("parity, equal buckets")
        check_parity(checks, groups, odd_model, ODD_BUCKET_MB, odd, "odd")
        clock("parity, odd buckets")
        check_training(checks, groups)
        clock("training")
        check_local_sgd(checks, groups)
        check_outer(checks, groups)
        check_outer_auto(checks, groups)
        clock("local SGD, outer steps")
        check_bf16_sum(checks, groups)
        check_nonfinite(checks, groups)
        clock("bf16 sums, non-finite steps")
    except Exception:
        checks["script"] = result(False, traceback.format_exc())
        raise
    finally:
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(checks, f, indent=1)
        dist.destroy_process_group()


class Clock:
    def __init__(self, rank: int) -> None:
        self.rank, self.last = rank, time.perf_counter()

    def __call__(self, what: str) -> None:
        now = time.perf_counter()
        if self.rank == 0:
            print(f"[collectives_ddp] {what}: {now - self.last:.1f} s", flush=True)
        self.last = now
