"""Graph sharding: exact gradients, untouched state_dict, peak RSS within budget, re-planning, bad input.

In-process tests plan with ``make_plan`` on a profiled step (budgets relative to the unsharded estimate, no
RSS involved) or with ``GraphSharder`` and explicit byte budgets; the peak-RSS test measures fresh processes.
"""

import contextlib
import copy
import gc
import io
import json
import logging
import re
from pathlib import Path

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.demos.transformer import LightningTransformer
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lightning_horizon import HorizonPrecision, HorizonStrategy, ThroughputMFUMonitor
from lightning_horizon.memory import current_rss
from lightning_horizon.sharding import (
    GraphSharder,
    InfeasibleBudgetError,
    ShardingConfig,
    ShardPlan,
    evaluate,
    install,
    make_plan,
    profile_step,
    resolve_budget,
    resolve_sharding,
)
from tests.launch import run_scripts
from tests.scripts.sharding_models import Branchy, LitGPT, tiny_gpt

MODELS = Path(__file__).parent / "scripts" / "sharding_models.py"
# RSS that follows the live tensors (see docs/sharding.md): the test checks the planner, not glibc's caching.
GLIBC_RETURNS = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576:glibc.malloc.hugetlb=1"}


def gpt_batch(n=4, seq=16, vocab=64):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, (n, seq), generator=g), torch.randint(0, vocab, (n, seq), generator=g)


def branchy_batch(n=256):
    g = torch.Generator().manual_seed(4)
    return torch.randn(n, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def step_grads(model, batch, seed):
    torch.manual_seed(seed)  # same dropout stream for both models
    loss = model.training_step(batch, 0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def plan_at(model, batch, fraction):
    """Profile, then plan for ``fraction`` of the unsharded activation estimate (nothing resident)."""
    prof = profile_step(model, batch)
    full = make_plan(prof, budget=1 << 40, fixed=0, headroom=1.0)
    return prof, make_plan(prof, budget=int(full.estimated_peak * fraction), fixed=0, headroom=1.0)


def assert_same_training(plain, sharded, batch, handle, steps=2):
    for seed in range(steps):
        handle.reset()  # the step boundary
        loss_a, grads_a = step_grads(plain, batch, seed)
        loss_b, grads_b = step_grads(sharded, batch, seed)
        assert torch.equal(loss_a, loss_b)
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-6, atol=1e-7, msg=name)


# ------------------------------------------------------------------ gradients


def test_gpt_gradients_match_with_dropout():
    torch.manual_seed(0)
    plain = tiny_gpt(layers=3, dropout=0.1)
    sharded = copy.deepcopy(plain)
    _, plan = plan_at(sharded, gpt_batch(), 0.5)
    modes = {s.mode for s in plan.shards}
    assert modes == {"store", "recompute"}, plan.table()  # a real mix, not all or nothing
    handle = install(sharded, plan.recompute, plan.counted)
    assert_same_training(plain, sharded, gpt_batch(), handle)


@pytest.mark.parametrize("fraction", [0.6, 0.0])
def test_branching_model_gradients_match(fraction):
    torch.manual_seed(0)
    plain = Branchy()
    sharded = copy.deepcopy(plain)
    prof = profile_step(sharded, branchy_batch())
    reasons = {c.name: c.reason for c in prof.calls}
    assert "state" in reasons["norm"] and "state" in reasons[""]  # BatchNorm's running stats: never recomputed
    full = make_plan(prof, budget=1 << 40, fixed=0, headroom=1.0)
    if fraction:
        plan = make_plan(prof, budget=int(full.estimated_peak * fraction), fixed=0, headroom=1.0)
    else:  # everything that may be recomputed is: both calls of the shared module, towers' leaves
        plan = make_plan(prof, budget=1, fixed=0, headroom=1.0, best_effort=True)
        assert {("shared.0", 0), ("shared.0", 1)} <= set(plan.recompute) or {("shared", 0), ("shared", 1)} <= set(
            plan.recompute
        ), plan.recompute
    assert plan.recompute and "norm" not in {n for n, _ in plan.recompute}
    handle = install(sharded, plan.recompute, plan.counted)
    assert_same_training(plain, sharded, branchy_batch(), handle)
    assert torch.equal(plain.norm.running_mean, sharded.norm.running_mean)
    assert torch.equal(plain.norm.num_batches_tracked, sharded.norm.num_batches_tracked)


# ------------------------------------------------------------------ state_dict and uninstall


def test_state_dict_keys_unchanged_and_strict_load_into_plain_module():
    torch.manual_seed(0)
    model = tiny_gpt(layers=3)
    users_own = model.blocks[1].forward  # an instance-level forward of the user's: must come back as it was
    model.blocks[1].forward = users_own
    keys = list(model.state_dict())
    _, plan = plan_at(model, gpt_batch(), 0.5)
    handle = install(model, plan.recompute, plan.counted)
    assert handle.modules and list(model.state_dict()) == keys
    step_grads(model, gpt_batch(), 0)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = tiny_gpt(layers=3)
    fresh.load_state_dict(torch.load(buf, weights_only=True), strict=True)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    handle.remove()
    assert model.blocks[1].__dict__["forward"] is users_own
    assert all("forward" not in m.__dict__ for n, m in model.named_modules() if n != "blocks.1")


# ------------------------------------------------------------------ untraceable, data-dependent, manual steps


class Gate(nn.Module):
    """Data-dependent: reads a value back into Python and branches on it; FakeTensor cannot run it."""

    def __init__(self, d):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.a(x) if x.mean().item() > 0 else self.b(x)


class Untraceable(nn.Module):
    def __init__(self, d=16, depth=4):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.body = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d)) for _ in range(depth)
        )
        self.gate = Gate(d)
        self.out = nn.Linear(d, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.inp(x)
        for block in self.body:
            h = h + block(h)
        h = self.gate(h)
        # numpy in the step: fake tensors cannot be converted, so the profile runs a real slice of the batch
        h = h * torch.from_numpy(x[:, :1].detach().numpy().copy())
        return nn.functional.cross_entropy(self.out(h), y)


def test_untraceable_module_profiles_for_real_and_still_trains():
    torch.manual_seed(0)
    plain = Untraceable()
    model = copy.deepcopy(plain)
    g = torch.Generator().manual_seed(5)
    batch = (torch.randn(128, 4, generator=g), torch.randint(0, 3, (128,), generator=g))
    prof, plan = plan_at(model, batch, 0.6)
    assert prof.mode == "real" and prof.batch_scale == 4.0 and "fake pass failed" in prof.note
    assert "data-dependent" in {c.name: c.reason for c in prof.calls}["gate"]
    assert plan.recompute and "gate" not in {n for n, _ in plan.recompute}
    handle = install(model, plan.recompute, plan.counted)
    assert_same_training(plain, model, batch, handle)


class ManualStep(nn.Module):
    """Manual optimization: the profiling pass must neither step nor call backward."""

    automatic_optimization = False

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.logged = []

    def optimizers(self):
        raise AssertionError("the profiling pass must not reach the real optimizers")

    def manual_backward(self, loss):
        raise AssertionError("the profiling pass must not run backward")

    def log(self, *args, **kwargs):
        self.logged.append(args)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.lin(batch).square().mean()
        self.log("loss", loss)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


def test_profile_silences_logging_backward_and_optimizers():
    model = ManualStep()
    before = copy.deepcopy(model.state_dict())
    prof = profile_step(model, torch.randn(8, 4))
    assert prof.calls[0].name == "lin" and model.logged == []
    assert "optimizers" not in model.__dict__ and "log" not in model.__dict__
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------ budgets and bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"budget": 0}, r"ShardingConfig\(budget=0\): allowed is .*an int must be > 0"),
        ({"budget": -5}, r"ShardingConfig\(budget=-5\): allowed is .*an int must be > 0"),
        ({"budget": -0.5}, r"ShardingConfig\(budget=-0.5\): allowed is .*an int must be > 0"),
        ({"budget": 1.5}, r"ShardingConfig\(budget=1.5\): allowed is a float in \(0, 1\] \(a fraction .*budget=1$"),
        ({"budget": True}, r"ShardingConfig\(budget=True\): allowed is an int"),
        ({"budget": "4GB"}, r"ShardingConfig\(budget='4GB'\): allowed is an int"),
        ({"headroom": 0}, r"ShardingConfig\(headroom=0\): allowed is a number in \(0, 1\]"),
        ({"relax_below": 0.96}, r"ShardingConfig\(relax_below=0.96\): allowed is a number below headroom=0.95"),
        ({"relax_after": 0}, r"ShardingConfig\(relax_after=0\): allowed is an int >= 1"),
        ({"profile": "trace"}, r"ShardingConfig\(profile='trace'\): allowed is one of \('auto', 'fake', 'real'\)"),
        ({"allocator_overhead": 0.5}, r"\(allocator_overhead=0.5\): allowed is None \(auto\) or in \[1, 10\]"),
    ],
)
def test_config_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardingConfig(**kwargs)


def test_resolve_sharding_argument():
    assert resolve_sharding(None) is None
    assert resolve_sharding("auto") == ShardingConfig()
    cfg = ShardingConfig(budget=0.5)
    assert resolve_sharding(cfg) is cfg
    with pytest.raises(ValueError, match=r"\(sharding='on'\): allowed is None, 'auto' or a ShardingConfig"):
        resolve_sharding("on")
    with pytest.raises(ValueError, match=r"ShardingConfig\(budget=1000000\)"):
        resolve_sharding(1_000_000)
    assert resolve_budget(ShardingConfig(budget=123456)) == 123456
    share = resolve_budget(ShardingConfig(budget=1.0))
    # two readings of the node's free memory: other processes move it a little in between
    assert current_rss() < share and resolve_budget(ShardingConfig(budget=0.5)) <= share // 2 + share // 100


def test_infeasible_budget_states_the_smallest_feasible_one():
    model = tiny_gpt(layers=3)
    prof = profile_step(model, gpt_batch())
    fixed = 10 << 20
    with pytest.raises(InfeasibleBudgetError, match=r"needs a budget of at least (\d+) bytes") as info:
        make_plan(prof, budget=fixed, fixed=fixed)
    smallest = int(re.search(r"at least (\d+) bytes", str(info.value))[1])
    assert smallest == info.value.smallest_feasible
    plan = make_plan(prof, budget=smallest, fixed=fixed)
    # a recompute plan aims at headroom (95%) of the budget; one that recomputes nothing at the budget itself
    assert plan.estimated_peak <= (int(smallest * 0.95) if plan.recompute else smallest)
    with pytest.raises(InfeasibleBudgetError):
        make_plan(prof, budget=int(smallest * 0.99), fixed=fixed)
    # Through the sharder: raised at the first step, before anything is installed.
    sharder = GraphSharder(ShardingConfig(budget=current_rss() // 2))
    with pytest.raises(ValueError, match=r"smallest feasible plan.*at least \d+ bytes"):
        sharder.maybe_plan(model, gpt_batch(), 0)
    assert all("forward" not in m.__dict__ for m in model.modules())


# ------------------------------------------------------------------ GraphSharder: adaptivity, checkpoint state


def _probe(model, batch):
    """(resident bytes, unsharded activation estimate) as a sharder sees them in this process now. Earlier tests'
    garbage is collected first: collected during a profile instead, it took 83 MiB off the resident set between this
    probe and the plan it sizes a budget for (one CI run), and the plan under test then fitted without recompute."""
    gc.collect()
    probe = GraphSharder(ShardingConfig(budget=1 << 40, allocator_overhead=1.0))
    probe.maybe_plan(model, batch, 0)
    probe.uninstall()
    return probe.fixed, probe.plan.estimated_peak - probe.fixed


def test_whole_step_within_budget_recomputes_nothing_until_a_step_exceeds_it_by_the_margin(caplog):
    torch.manual_seed(0)
    model, batch = tiny_gpt(layers=4, seq=64), gpt_batch(16, 64)
    fixed, act = _probe(model, batch)
    budget = int((fixed + act) / 0.97)  # the plain step's estimated peak is 97% of it: above headroom 95%
    sharder = GraphSharder(ShardingConfig(budget=budget, allocator_overhead=1.0))
    sharder.maybe_plan(model, batch, 0)
    assert sharder.plan.recompute == [] and sharder.plan.target == budget, sharder.plan_table()
    assert 0.95 * budget < sharder.plan.estimated_peak <= budget
    caplog.set_level(logging.INFO, logger="lightning_horizon.sharding")
    sharder.after_step(peak=int(1.04 * budget))  # within noise of the plain step's peak: nothing to correct
    sharder.maybe_plan(model, batch, 1)
    assert sharder.plan.recompute == [] and "more recompute" not in caplog.text
    sharder.after_step(peak=int(1.06 * budget))  # over the budget by more than the headroom margin
    sharder.maybe_plan(model, batch, 2)
    assert sharder.plan.recompute, sharder.plan_table()
    assert "above 105% of it (nothing recomputed)" in caplog.text and "more recompute" in caplog.text
    # a headroom below the whole step's estimate does not make a plan that fits the budget recompute either
    tight = GraphSharder(ShardingConfig(budget=budget, allocator_overhead=1.0, headroom=0.5, relax_below=0.4))
    tight.maybe_plan(model, batch, 0)
    assert tight.plan.recompute == []
    sharder.uninstall(), tight.uninstall()


def test_replans_tighter_above_headroom_and_relaxes_when_far_under(caplog):
    torch.manual_seed(0)
    model, batch = tiny_gpt(layers=4, seq=64), gpt_batch(16, 64)
    fixed, act = _probe(model, batch)
    # Room for 5x the activations: what a peak that the estimate missed by far will need.
    budget = int((fixed + 5 * act) / 0.95)
    sharder = GraphSharder(ShardingConfig(budget=budget, allocator_overhead=1.0, relax_after=3, relax_below=0.94))
    sharder.maybe_plan(model, batch, 0)
    assert sharder.plan.recompute == []
    fixed, act = sharder.fixed, sharder.plan.estimated_peak - sharder.fixed  # this process's RSS moves a little
    caplog.set_level(logging.INFO, logger="lightning_horizon.sharding")
    sharder.after_step(peak=int(1.06 * budget))  # the estimate missed by far: 6% over the budget
    sharder.maybe_plan(model, batch, 1)
    assert sharder.plan.recompute, sharder.plan_table()
    assert sharder.scale > 5 and "(nothing recomputed)" in caplog.text and "more recompute" in caplog.text
    tight = len(sharder.plan.recompute)
    sharder.after_step(peak=int(0.97 * budget))  # a recompute plan above headroom: more recompute again
    assert sharder._pending is not None and "above headroom 95%" in sharder._pending[0]
    sharder.maybe_plan(model, batch, 2)
    tight = len(sharder.plan.recompute)
    for i in range(3):
        sharder.after_step(peak=fixed + 2 * act)  # far under budget, three steps running
        sharder.maybe_plan(model, batch, 3 + i)
    assert len(sharder.plan.recompute) < tight and "less recompute" in caplog.text
    assert [h["reason"].split(" ")[0] for h in sharder.history][:3] == ["first", "measured", "measured"]
    sharder.uninstall()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_checkpoint_state_restores_the_same_plan():
    torch.manual_seed(0)
    model, batch = tiny_gpt(layers=4, seq=64), gpt_batch(16, 64)
    fixed, act = _probe(model, batch)
    # headroom 0.99: 5% of this process's resident memory is more than the tiny model's activations
    budget = int((fixed + 0.6 * act) / 0.99)
    sharder = GraphSharder(ShardingConfig(budget=budget, allocator_overhead=1.0, headroom=0.99))
    sharder.maybe_plan(model, batch, 0)
    assert sharder.plan.recompute
    assert "recompute" in sharder.plan_table() and "est. peak" in sharder.plan_table()
    buf = io.BytesIO()
    torch.save(sharder.state_dict(), buf)  # plain Python data: loads with weights_only
    sharder.uninstall()
    buf.seek(0)
    resumed = GraphSharder(ShardingConfig(budget=budget, allocator_overhead=1.0, headroom=0.99))
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    resumed.maybe_plan(model, batch, 0)
    assert resumed.plan.recompute == sharder.plan.recompute
    assert resumed.history[-1]["reason"] == "restored from the checkpoint"
    assert ShardPlan.from_dict(sharder.plan.to_dict()) == sharder.plan
    again = evaluate(resumed.profile, sharder.plan.recompute, budget, resumed.fixed, 0.99)
    assert again is not None and again.recompute == sharder.plan.recompute
    resumed.uninstall()
    with pytest.raises(ValueError, match="version"):
        resumed.load_state_dict({"version": 99})


# ------------------------------------------------------------------ peak RSS in fresh processes


def _run_models(*runs):
    """One fresh process per run (its args), all at once: each measures its own RSS."""
    outs = run_scripts([(MODELS, [str(a) for a in args], GLIBC_RETURNS) for args in runs], timeout=120)
    return [json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0]) for out in outs]


def test_peak_rss_stays_within_budget():
    (plain,) = _run_models(["plain"])
    fractions = (0.4, 1.0)  # recompute needed / not needed
    rows = list(zip(fractions, _run_models(*(["sharded", f, plain["base"], plain["peak"]] for f in fractions))))
    for fraction, r in rows:
        assert r["peak"] <= 1.1 * r["budget"], f"{fraction:.0%}: peak {r['peak']} > 1.1 x budget {r['budget']}"
        assert abs(r["loss"] - plain["loss"]) < 1e-4  # same training, less memory
    assert "recompute" in rows[0][1]["table"]  # 40% of the activations cannot be met without recompute
    for fraction, r in rows:
        act = (r["peak"] - plain["base"]) / (plain["peak"] - plain["base"])
        print(f"budget {fraction:.0%}: peak/budget {r['peak'] / r['budget']:.3f}, activations {act:.0%} of plain,"
              f" cpu s/step {min(r['cpu_s']):.2f} vs {min(plain['cpu_s']):.2f} plain")


# ------------------------------------------------------------------ through Lightning and HorizonStrategy


def _lit_data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 64, (64, 128), generator=g), torch.randint(0, 64, (64, 128), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _lit_fit(sharding, tmp_path=None):
    L.seed_everything(0, verbose=False)
    model = LitGPT()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HorizonStrategy(sharding=sharding), max_steps=3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, _lit_data())
    return model, trainer


def test_horizon_strategy_trains_the_same_model_in_less_memory(tmp_path):
    with pytest.raises(ValueError, match=r"\(sharding='on'\): allowed is None, 'auto' or a ShardingConfig"):
        HorizonStrategy(sharding="on")
    plain, _ = _lit_fit(None)
    # Room for 60% of the unsharded activations above what is resident now (Lightning adds a few MB by the
    # first step: the planner measures that itself).
    fixed, act = _probe(LitGPT(), next(iter(_lit_data())))
    # (headroom 0.99: 5% of this process's resident memory is more than the tiny model's activations)
    budget = int((fixed + 0.6 * act) / 0.99)
    model, trainer = _lit_fit(ShardingConfig(budget=budget, allocator_overhead=1.0, adaptive=False, headroom=0.99),
                              tmp_path)
    sharder = trainer.strategy.sharder
    assert sharder.plan.recompute and sharder.history[0]["reason"] == "first plan"
    assert all("forward" not in m.__dict__ for m in model.modules())  # teardown uninstalled the plan
    torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(plain.losses), rtol=1e-6, atol=0)
    for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=name)
    # The plan travels in the checkpoint under the strategy's key; the weights load into a plain module.
    path = tmp_path / "sharded.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=False)
    assert ckpt["HorizonStrategy"]["ranks"][0]["sharding"]["plan"]["recompute"]
    LitGPT().load_state_dict(ckpt["state_dict"], strict=True)


# ------------------------------------------------------------------ own generators, user state, fake tensors, precision


class NoisyBlock(nn.Module):
    """A dropout-like mask drawn from the block's own torch.Generator: a recompute cannot replay it."""

    def __init__(self, d, seed):
        super().__init__()
        self.up, self.down = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU()), nn.Linear(4 * d, d)
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, x):
        h = self.up(x)  # recomputable: it saves more than its input
        keep = torch.rand(h.shape, generator=self.gen) > 0.25
        return self.down(h * keep / 0.75)


class NoisyNet(nn.Module):
    def __init__(self, d=16, depth=3):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(NoisyBlock(d, seed) for seed in range(depth))
        self.out = nn.Linear(d, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return nn.functional.cross_entropy(self.out(h), y)


@pytest.mark.parametrize("mode", ["fake", "real"])
def test_module_drawing_from_its_own_generator_is_not_recomputed(mode):
    torch.manual_seed(0)
    plain = NoisyNet()
    sharded = copy.deepcopy(plain)
    g = torch.Generator().manual_seed(6)
    batch = (torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g))
    prof = profile_step(sharded, batch, mode=mode)
    reasons = {c.name: c.reason for c in prof.calls}
    assert "own torch.Generator" in reasons["blocks.0"] and reasons["blocks.0.up"] == ""
    plan = make_plan(prof, budget=1, fixed=0, headroom=1.0, best_effort=True)  # recompute all that may be
    assert ("blocks.0.up", 0) in plan.recompute and not {"blocks.0", "blocks.1", "blocks.2"} & {
        n for n, _ in plan.recompute}, plan.recompute
    handle = install(sharded, plan.recompute, plan.counted)
    for step in range(2):
        handle.reset()
        for model in (plain, sharded):
            for i, block in enumerate(model.blocks):
                block.gen.manual_seed(10 * step + i)  # the same private streams for both models
        loss_a, grads_a = step_grads(plain, batch, step)
        loss_b, grads_b = step_grads(sharded, batch, step)
        assert torch.equal(loss_a, loss_b)
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), name


class Counting(L.LightningModule):
    """Python state that training_step changes: a counter, a list, a torchmetrics metric, a cached attribute and a
    private generator. The sharding profile runs training_step once more; none of it may show."""

    def __init__(self):
        super().__init__()
        self.net = tiny_gpt(layers=2, seq=32, dropout=0.1)
        self.mean_loss = torchmetrics.MeanMetric()
        self.calls, self.seen = 0, []
        self.gen = torch.Generator().manual_seed(1)

    def training_step(self, batch, batch_idx):
        self.calls += 1
        self.seen.append((batch_idx, torch.rand((), generator=self.gen)))
        loss = self.net.training_step(batch, batch_idx)
        self.mean_loss.update(loss.detach())
        self.net.last_loss = loss.detach()  # an attribute the step caches on a submodule
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(model, data, sharding=None, plugins=None, callbacks=None, steps=3):
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HorizonStrategy(sharding=sharding), max_steps=steps,
                        plugins=plugins, callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)
    return trainer


@pytest.mark.parametrize("profile", ["auto", "real"])
def test_profile_leaves_no_trace_in_user_state(profile):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (12, 32), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.roll(-1, 1)), batch_size=4)
    runs = []
    for sharding in (None, ShardingConfig(profile=profile, adaptive=False)):
        L.seed_everything(0, verbose=False)
        model = Counting()
        trainer = _fit(model, data, sharding)
        runs.append(model)
    plain, sharded = runs
    assert trainer.strategy.sharder.profile is not None
    assert sharded.calls == 3 and [i for i, _ in sharded.seen] == [0, 1, 2]
    assert torch.equal(torch.stack([r for _, r in sharded.seen]), torch.stack([r for _, r in plain.seen]))
    assert sharded.mean_loss._update_count == 3
    assert torch.equal(sharded.mean_loss.compute(), plain.mean_loss.compute())
    assert torch.equal(sharded.net.last_loss, plain.net.last_loss)


class Compiled(L.LightningModule):
    """A user's ``torch.compile``: the net compiled in place in configure_model, with a backend that counts the
    graphs dynamo hands it and the calls of the compiled code (no inductor: the test is about dynamo's capture)."""

    def __init__(self, compiled: bool):
        super().__init__()
        self.net, self.compiled, self.graphs, self.calls = tiny_gpt(layers=2, seq=32), compiled, 0, 0

    def configure_model(self):
        if self.compiled:
            self.net.compile(backend=self._backend)

    def _backend(self, gm, example_inputs):
        self.graphs += 1

        def run(*args):
            self.calls += 1
            return gm.forward(*args)

        return run

    def training_step(self, batch, batch_idx):
        return self.net.training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_compiled_model_stays_compiled_through_the_profile_and_the_flop_count():
    """The sharding profile and the monitor's FLOP count run the step under dispatch modes; dynamo refuses a frame
    under one and marks its code "skip" for good, which ran a user's compiled model eagerly for the whole fit."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (20, 32), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.roll(-1, 1)), batch_size=4)
    runs = []
    for compiled in (False, True):
        L.seed_everything(0, verbose=False)
        model = Compiled(compiled)
        monitor = ThroughputMFUMonitor(window_size=2)  # no flops_per_batch: it counts training batch 2
        trainer = _fit(model, data, ShardingConfig(profile="real", adaptive=False), callbacks=[monitor], steps=5)
        assert trainer.strategy.sharder.profile is not None and monitor.flops_per_batch > 0
        runs.append(model)
    eager, compiled = runs
    # one graph, run by every step but the counted one (batch 2 runs eagerly under the count)
    assert compiled.graphs == 1 and compiled.calls == 4
    for (name, a), b in zip(eager.state_dict().items(), compiled.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


class DemoTransformer(LightningTransformer):
    def prepare_data(self):  # WikiText2 is a download: random tokens of the same shapes stand in for it
        pass


class RealOutputs(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        assert not any(isinstance(t, FakeTensor) or t.is_meta for t in outputs.values())
        self.losses.append(float(outputs["loss"]))


def test_lightning_demo_transformer_trains_sharded_with_real_outputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (12, 35), generator=g)  # WikiText2's block_size, a small vocabulary
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.roll(-1, 1)), batch_size=4)
    losses = []
    for sharding in (None, "auto"):
        L.seed_everything(0, verbose=False)
        callback = RealOutputs()
        _fit(DemoTransformer(vocab_size=64), data, sharding, callbacks=[callback])
        losses.append(callback.losses)
    assert len(losses[1]) == 3 and losses[1] == losses[0]
    # The guard: a fake tensor handed back from training_step is refused, with the way out.
    with FakeTensorMode():
        fake = torch.ones(())
    with pytest.raises(RuntimeError, match=r"training_step returned a FakeTensor.*profile='real'"):
        GraphSharder().check_output({"loss": fake})


@pytest.mark.parametrize("master", ["fp32", "kahan"])
def test_recompute_runs_under_the_precision_context(master, monkeypatch):
    """bf16-true weights computed in fp32: the forward swaps in fp32 copies only while training_step runs, and the
    recompute (in backward) must see them too."""
    def recompute_all(self, scale, best_effort=False):  # the smallest plan, whatever the RSS: all it can
        return make_plan(self.profile, 1, 0, 1.0, best_effort=True)

    with pytest.raises(ValueError, match=r"recompute_context=1: must be None or a callable"):
        GraphSharder(recompute_context=1)
    runs = []
    for sharding in (None, ShardingConfig(budget=1.0, adaptive=False)):  # the rank's whole share
        if sharding is not None:
            monkeypatch.setattr(GraphSharder, "_make_plan", recompute_all)
        L.seed_everything(0, verbose=False)
        model = LitGPT()
        trainer = _fit(model, _lit_data(), sharding, plugins=[HorizonPrecision("bf16-true", master, "fp32")])
        runs.append(model)
    sharder = trainer.strategy.sharder
    assert len(sharder.plan.recompute) > 3 and sharder.recompute_context == trainer.precision_plugin.recompute_context
    for (name, a), b in zip(runs[0].state_dict().items(), runs[1].state_dict().values()):
        assert a.dtype == torch.bfloat16 or not a.is_floating_point(), name
        assert torch.equal(a, b), name


class ScaledBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

    def forward(self, h):
        return h + self.mlp(h) * torch.linspace(0.5, 1.5, h.shape[-1])  # a tensor of the default dtype


class MakesDefaultDtype(L.LightningModule):
    """Blocks that create a tensor of the default dtype in their forward (as a positional table or a mask built
    with torch.ones/arange would): bf16 inside bf16-true's step, so the recompute must see bf16 as well."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(ScaledBlock() for _ in range(3))
        self.head = torch.nn.Linear(16, 32)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return torch.nn.functional.cross_entropy(self.head(h).float().flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_recompute_sees_the_default_dtype_of_the_step(monkeypatch):
    """bf16-true with bf16 compute makes bf16 the default dtype inside the step (as Lightning's bf16-true does);
    a recompute in backward must run with it too, or it makes fp32 tensors where the forward made bf16 ones."""
    def recompute_blocks(self, scale, best_effort=False):  # the blocks themselves, where the tensor is made
        from lightning_horizon.sharding.plan import evaluate

        blocks = [(f"blocks.{i}", 0) for i in range(3)]
        return evaluate(self.profile, blocks, self.budget, self.fixed, 1.0, scale, self._grads_in_forward)

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32, (8, 8), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.roll(-1, 1)), batch_size=4)
    runs = []
    for sharding in (None, ShardingConfig(budget=1.0, adaptive=False)):  # the rank's whole share
        if sharding is not None:
            monkeypatch.setattr(GraphSharder, "_make_plan", recompute_blocks)
        L.seed_everything(0, verbose=False)
        model = MakesDefaultDtype()
        trainer = _fit(model, data, sharding, plugins=[HorizonPrecision("bf16-true", "kahan", "bf16")], steps=2)
        runs.append(model)
    assert trainer.strategy.sharder.plan.recompute == [("blocks.0", 0), ("blocks.1", 0), ("blocks.2", 0)]
    for (name, a), b in zip(runs[0].state_dict().items(), runs[1].state_dict().values()):
        assert torch.equal(a, b), name


def test_checkpointed_calls_inside_a_compiled_module_give_the_uncompiled_gradients():
    """A planned call that dynamo traces (the module compiled; AOT autograd, as inductor's front half, running its
    graphs eagerly) is checkpointed inside the compiled graph, dropout included: the gradients of the plain module.
    (Our checkpoint's context_fn made dynamo raise there.)"""
    from torch._dynamo.backends.common import aot_autograd

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 8)).double()

    def grads(model: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        x = torch.randn(4, 8, dtype=torch.float64)
        model(x).square().sum().backward()
        return [p.grad for p in model.parameters()]

    plain = grads(build())
    torch._dynamo.reset()
    model = build()
    handle = install(model, [("0", 0), ("2", 0)], recompute_context=lambda m: contextlib.nullcontext())
    model.compile(backend=aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm))
    try:
        for got, want in zip(grads(model), plain):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    finally:
        handle.remove()
        torch._dynamo.reset()
