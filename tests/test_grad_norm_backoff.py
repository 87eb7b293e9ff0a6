"""GradNormBackoff: spike backoff and recovery, true NaN skips, scheduler composition, manual optimization,
accumulation and precision plugins, 2-rank agreement, resume mid-backoff, and input validation.

Tiny models, a handful of steps each; the data depends only on ``global_step`` so that a resumed run sees exactly
the batches the uninterrupted run saw.
"""

from __future__ import annotations

import copy
import json
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers.logger import Logger
from torch import nn

from lightning_horizon import GradNormBackoff
from lightning_horizon.gradnorm import total_norm_fp32
from tests.launch import assert_exited, run_worlds

NAMES = ("grad_norm", "lr_scale", "spikes", "skipped_steps")


class ListLogger(Logger):
    """Keeps every ``log_metrics`` call in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []

    @property
    def name(self) -> str:
        return "list"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class Tiny(L.LightningModule):
    def __init__(self, opt="sgd", lr=0.1, sched=None, spike_at=(), nan_at=()) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.opt, self.lr, self.sched = opt, lr, sched
        self.spike_at, self.nan_at = set(spike_at), set(nan_at)
        self.seen: list[dict] = []  # one row per optimizer step, as the step itself sees it
        self.losses: list[float] = []
        self.snapshots: dict[str, tuple] = {}

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(1234 + self.global_step)
        x = torch.randn(16, 8, generator=g)
        loss = F.mse_loss(self.net(x.to(self.dtype)).float(), torch.sin(x.sum(1, keepdim=True)))
        self.losses.append(loss.item())
        if self.global_step in self.spike_at:
            loss = loss * 1e6
        if self.global_step in self.nan_at:
            loss = loss * float("nan")
        return loss

    def on_before_optimizer_step(self, optimizer):
        # the module's hook runs after the callbacks': the lr is scaled and the gradients clipped by now
        self.seen.append(dict(step=self.global_step, lrs=[g["lr"] for g in optimizer.param_groups],
                              clipped_norm=total_norm_fp32(self.parameters()).item(),
                              grads=[None if p.grad is None else p.grad.detach().clone() for p in self.parameters()]))

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step in self.nan_at:
            self.snapshots["before"] = _snapshot(self, self.trainer.optimizers[0])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step - 1 in self.nan_at:
            self.snapshots["after"] = _snapshot(self, self.trainer.optimizers[0])
        if self.seen:
            self.seen[-1]["lr_after"] = self.trainer.optimizers[0].param_groups[0]["lr"]

    def configure_optimizers(self):
        if self.opt == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        if self.sched is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.sched(opt), "interval": "step"}}


class PreClipGrads(L.Callback):
    """The gradients as the step's first callback sees them: listed before GradNormBackoff, before its clip."""

    def __init__(self) -> None:
        self.rows: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.rows.append([p.grad.detach().clone() for p in pl_module.parameters()])


def torch_clipped(grads: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> list[torch.Tensor]:
    """``torch.nn.utils.clip_grad_norm_`` applied to a copy of ``grads``: the reference clip."""
    params = [nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    return [p.grad for p in params]


def flat_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> float:
    """The reference norm: float64, over all gradients concatenated."""
    return torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads]), norm_type).item()


def _snapshot(module, optimizer):
    return (copy.deepcopy(module.state_dict()), copy.deepcopy(optimizer.state_dict()["state"]))


def _fit(model, callbacks, max_steps, tmp_path, ckpt_path=None, **kwargs):
    kwargs.setdefault("logger", False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, log_every_n_steps=1,
        **kwargs,
    )
    trainer.fit(model, torch.utils.data.DataLoader(torch.arange(1000), batch_size=1), ckpt_path=ckpt_path)
    return trainer


def _scales(model, base_lr):
    return [row["lrs"][0] / base_lr for row in model.seen]


# 64-true: float64 gradients are clipped by a float64 coefficient, as torch's clip_grad_norm_ does (float32
# rounding of the coefficient alone would be ~1e-8 off)
@pytest.mark.parametrize("precision, rtol", [("32-true", 1e-6), ("64-true", 1e-15)])
def test_spike_backs_off_once_and_recovers(tmp_path, precision, rtol):
    torch.manual_seed(0)
    backoff = GradNormBackoff(max_norm=1.0, spike_threshold=1e4, factor=0.8, recover_after=4)
    model, logger, pre = Tiny(lr=0.1, spike_at=[3]), ListLogger(), PreClipGrads()
    _fit(model, [pre, backoff], 10, tmp_path, logger=logger, precision=precision)

    assert _scales(model, 0.1) == pytest.approx([1, 1, 1, 0.8, 0.8, 0.8, 0.8, 1, 1, 1], abs=1e-12)
    assert backoff.spikes == 1 and backoff.skipped_steps == 0 and backoff.lr_scale == 1.0
    assert all(row["lr_after"] == 0.1 for row in model.seen)  # the scheduler's lr is back after every step
    # the step uses exactly torch's clip of the unclipped gradients (the spike's, at least, needed clipping)
    assert len(pre.rows) == 10 and flat_norm(pre.rows[3]) > 1e4
    assert pre.rows[3][0].dtype == (torch.float64 if precision == "64-true" else torch.float32)
    for unclipped, row in zip(pre.rows, model.seen):
        torch.testing.assert_close(row["grads"], torch_clipped(unclipped, 1.0), rtol=rtol, atol=0)
    logged = [row for row in logger.rows if "grad_norm" in row]
    assert len(logged) == 10 and all(set(NAMES) <= set(row) for row in logged)
    assert logged[3]["grad_norm"] > 1e4 and logged[3]["lr_scale"] == pytest.approx(0.8)
    assert [row["spikes"] for row in logged] == [0, 0, 0] + [1] * 7


class ClipsFirst(Tiny):
    """Manual optimization that clips to ``max_norm`` itself (``self.clip_gradients``) before ``opt.step()``:
    GradNormBackoff then sees a norm a hair under ``max_norm``, which clip_grad_norm_ still scales (its 1e-6)."""

    def __init__(self, max_norm: float) -> None:
        super().__init__(lr=0.1)
        self.automatic_optimization, self.max_norm = False, max_norm

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        self.clip_gradients(opt, gradient_clip_val=self.max_norm, gradient_clip_algorithm="norm")
        opt.step()


def test_a_norm_just_under_max_norm_is_clipped_as_clip_grad_norm_does(tmp_path):
    torch.manual_seed(0)
    model, pre = ClipsFirst(max_norm=0.05), PreClipGrads()
    _fit(model, [pre, GradNormBackoff(max_norm=0.05, spike_threshold=None)], 3, tmp_path, precision="64-true")
    assert len(pre.rows) == 3
    for unclipped, row in zip(pre.rows, model.seen):
        assert 0.05 - 1e-6 < flat_norm(unclipped) <= 0.05  # the user's clip left it in torch's 1e-6 window
        torch.testing.assert_close(row["grads"], torch_clipped(unclipped, 0.05), rtol=1e-15, atol=0)


def test_nan_step_is_skipped_bit_identically_and_training_goes_on(tmp_path):
    torch.manual_seed(0)
    backoff = GradNormBackoff(recover_after=100)
    model = Tiny(opt="adamw", lr=0.01, nan_at=[4])
    _fit(model, [backoff], 8, tmp_path, gradient_clip_val=0.5)  # Lightning clips after us: a skip must survive it

    (w0, s0), (w1, s1) = model.snapshots["before"], model.snapshots["after"]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert s0.keys() == s1.keys() and len(s0) > 0
    for k in s0:  # AdamW moments and step counts untouched
        assert all(torch.equal(s0[k][name], s1[k][name]) for name in s0[k])
        assert float(s1[k]["step"]) == 4
    assert backoff.skipped_steps == 1 and backoff.spikes == 0 and backoff.lr_scale == pytest.approx(0.8)
    assert model.seen[4]["clipped_norm"] == 0.0  # the NaN grads were dropped (None), not left in place
    final = model.trainer.optimizers[0].state
    assert all(float(st["step"]) == 7 for st in final.values())  # 8 steps, one skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())


SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12),
    "linear": lambda opt: torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=12),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_effective_lr_is_scheduler_lr_times_scale(tmp_path, name):
    torch.manual_seed(0)
    backoff = GradNormBackoff(recover_after=3)
    model = Tiny(lr=0.1, sched=SCHEDULERS[name], spike_at=[2, 3, 8])
    _fit(model, [backoff], 12, tmp_path)

    # the same scheduler driven alone: the lrs it would have produced without any backoff
    ref_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    ref_sched, ref = SCHEDULERS[name](ref_opt), []
    for _ in range(12):
        ref.append(ref_opt.param_groups[0]["lr"])
        ref_opt.step()
        ref_sched.step()
    expected_scales = [1, 1, 0.8, 0.64, 0.64, 0.64, 0.8, 0.8, 0.64, 0.64, 0.64, 0.8]
    used = [row["lrs"][0] for row in model.seen]
    assert used == pytest.approx([r * s for r, s in zip(ref, expected_scales)], rel=1e-12)
    # no drift: after the last step the optimizer holds exactly the scheduler's own lr
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"], rel=1e-12)


class TwoOptimizers(L.LightningModule):
    """Manual optimization with two optimizers; optimizer 1's loss turns NaN at batch ``nan_at``."""

    def __init__(self, nan_at: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = nn.Linear(8, 1), nn.Linear(8, 1)
        self.nan_at = nan_at
        self.changed: list[tuple[bool, bool]] = []

    def training_step(self, batch, batch_idx):
        x = torch.randn(16, 8)
        before = [self.a.weight.detach().clone(), self.b.weight.detach().clone()]
        for i, (opt, net) in enumerate(zip(self.optimizers(), (self.a, self.b))):
            loss = (net(x) - 1).pow(2).mean()
            if i == 1 and batch_idx == self.nan_at:
                loss = loss * float("nan")
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.changed.append((not torch.equal(before[0], self.a.weight), not torch.equal(before[1], self.b.weight)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.Adam(self.b.parameters(), lr=0.1)


def test_manual_optimization_with_two_optimizers(tmp_path):
    torch.manual_seed(0)
    backoff, logger = GradNormBackoff(), ListLogger()
    model = TwoOptimizers(nan_at=2)
    _fit(model, [backoff], 10, tmp_path, logger=logger)  # manual: global_step counts both optimizers' steps

    assert model.changed[2] == (True, False) and all(c == (True, True) for i, c in enumerate(model.changed) if i != 2)
    s0, s1 = backoff.states
    assert (s0.steps, s0.skipped_steps, s0.scale) == (5, 0, 1.0)
    assert (s1.steps, s1.skipped_steps) == (5, 1) and s1.scale == pytest.approx(0.8)
    keys = set().union(*logger.rows)
    assert {f"{n}_opt{i}" for n in NAMES for i in (0, 1)} <= keys


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_gradient_accumulation_and_lightning_precision_plugins(tmp_path, precision):
    torch.manual_seed(0)
    backoff = GradNormBackoff(recover_after=2)
    model = Tiny(lr=0.05, spike_at=[1], nan_at=[3])
    _fit(model, [backoff], 5, tmp_path, accumulate_grad_batches=3, precision=precision)

    assert len(model.losses) == 15 and len(model.seen) == 5  # 3 micro-batches per step, one decision per step
    assert (backoff.states[0].steps, backoff.spikes, backoff.skipped_steps) == (5, 1, 1)
    # step 3 is skipped (no grads: its lr is left alone), and backs the scale off to 0.64
    assert _scales(model, 0.05) == pytest.approx([1, 0.8, 0.8, 1, 0.64], rel=1e-12)
    assert backoff.lr_scale == pytest.approx(0.64)
    assert all(math.isfinite(p.float().sum().item()) for p in model.parameters())


def test_horizon_precision(tmp_path):
    precision_mod = pytest.importorskip("lightning_horizon.precision")
    torch.manual_seed(0)
    backoff = GradNormBackoff(recover_after=2)
    model = Tiny(opt="adamw", lr=0.01, spike_at=[1], nan_at=[3])
    _fit(model, [backoff], 5, tmp_path, plugins=[precision_mod.HorizonPrecision("auto")])
    (w0, _), (w1, _) = model.snapshots["before"], model.snapshots["after"]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert (backoff.spikes, backoff.skipped_steps) == (1, 1)


@pytest.mark.parametrize("mode", ["bf16-mixed", "bf16-true"])
def test_the_step_norm_is_measured_once_by_horizon_precision(tmp_path, monkeypatch, mode):
    """HorizonPrecision owns the step's fp32 pre-clip norm: GradNormBackoff reads it instead of measuring again."""
    from lightning_horizon.callbacks import grad_norm_backoff
    from lightning_horizon.precision import HorizonPrecision

    class Seen(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.norms = getattr(self, "norms", []) + [float(trainer.precision_plugin.last_grad_norm)]

    def measured_again(*args, **kwargs):
        raise AssertionError("GradNormBackoff measured the norm HorizonPrecision already had")

    monkeypatch.setattr(grad_norm_backoff, "total_norm_fp32", measured_again)
    backoff, seen = GradNormBackoff(max_norm=0.1, spike_threshold=None), Seen()
    _fit(Tiny(), [backoff, seen], 3, tmp_path, plugins=[HorizonPrecision(mode, compute="fp32")])
    assert backoff.last_grad_norm == seen.norms[-1] > 0.1  # pre-clip, exactly the plugin's
    with pytest.raises(AssertionError, match="measured the norm"):  # another norm_type is measured here
        _fit(Tiny(), [GradNormBackoff(norm_type=1.0)], 1, tmp_path, plugins=[HorizonPrecision(mode, compute="fp32")])


# the data depends on global_step only, so a mid-epoch resume sees the same batches whatever Lightning warns
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_resume_mid_backoff_reproduces_lr_and_loss(tmp_path):
    def callbacks():  # two instances side by side: distinct state keys, both restored
        return [GradNormBackoff(max_norm=None, spike_threshold=None, spike_zscore=2.0, zscore_window=3,
                                recover_after=2, log_prefix="z/"),
                GradNormBackoff(max_norm=1.0, recover_after=4)]

    def model():
        return Tiny(opt="adamw", lr=0.01, spike_at=[3],
                    sched=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12))

    torch.manual_seed(0)
    full, full_cbs = model(), callbacks()
    _fit(full, full_cbs, 10, tmp_path / "full")

    torch.manual_seed(0)
    first, first_cbs = model(), callbacks()
    trainer = _fit(first, first_cbs, 5, tmp_path / "first")  # stops mid-backoff: scale 0.8, streak 1
    assert first_cbs[1].lr_scale == pytest.approx(0.8) and first_cbs[1].states[0].healthy_streak == 1
    ckpt = tmp_path / "k5.ckpt"
    trainer.save_checkpoint(ckpt)
    assert len([k for k in torch.load(ckpt, weights_only=False)["callbacks"] if "GradNormBackoff" in k]) == 2

    torch.manual_seed(1)  # different init: everything must come from the checkpoint
    second, second_cbs = model(), callbacks()
    _fit(second, second_cbs, 10, tmp_path / "second", ckpt_path=ckpt)

    assert [r["lrs"] for r in first.seen + second.seen] == [r["lrs"] for r in full.seen]
    assert first.losses + second.losses == full.losses
    assert [cb.state_dict() for cb in second_cbs] == [cb.state_dict() for cb in full_cbs]
    assert full_cbs[1].spikes == 1 and full_cbs[0].spikes >= 1  # the z-score instance saw the spike too


def test_two_ranks_take_identical_decisions(tmp_path):
    ended, _ = run_worlds([{"tag": "backoff", "call": "tests.scripts.backoff_fit:main", "args": [str(tmp_path), 10],
                            "devices": 2, "env": {"OMP_NUM_THREADS": "1"}}], tmp_path / "launch", timeout=100)
    assert_exited(ended, "backoff", [0, 0])
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == 2 and r1["rank"] == 1
    # json text compares NaN equal to NaN: norms, scales, counters, lrs and weights match bit for bit
    assert json.dumps(r0["steps"]) == json.dumps(r1["steps"])
    assert json.dumps(r0["state"]) == json.dumps(r1["state"])
    steps = r0["steps"]
    assert [s["spikes"] for s in steps] == [0, 0, 0] + [1] * 7  # spike injected on rank 0 only
    assert [s["skipped"] for s in steps] == [0] * 6 + [1] * 4  # NaN injected on rank 1 only
    assert steps[6]["weights"] == steps[5]["weights"] and steps[7]["weights"] != steps[6]["weights"]
    # rank-dependent local norms (1|2, 2|nan, inf|3) still give one answer everywhere
    assert json.dumps(r0["agreed"]) == json.dumps(r1["agreed"]) == json.dumps([2.0, float("nan"), float("inf")])


def test_state_key_and_state_round_trip():
    a, b = GradNormBackoff(), GradNormBackoff(max_norm=2.0)
    assert a.state_key != b.state_key and a.state_key == GradNormBackoff().state_key
    a.load_state_dict({"version": 1, "optimizers": [dict(scale=0.64, healthy_streak=3, spikes=2, skipped_steps=1,
                                                        steps=40, window=[1.0, 2.0])]})
    assert a.state_dict()["optimizers"][0]["window"] == [1.0, 2.0] and a.lr_scale == 0.64


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(factor=1.0), "factor"),
        (dict(factor=0.0), "factor"),
        (dict(factor=1.5), "factor"),
        (dict(max_norm=0.0), "max_norm"),
        (dict(max_norm=-1.0), "max_norm"),
        (dict(norm_type=0), "norm_type"),
        (dict(spike_threshold=-5.0), "spike_threshold"),
        (dict(spike_zscore=-1.0), "spike_zscore"),
        (dict(zscore_window=-3), "zscore_window"),
        (dict(zscore_window=1), "zscore_window"),
        (dict(recover_after=-1), "recover_after"),
        (dict(recover_after=0), "recover_after"),
        (dict(recover_factor=0.9), "recover_factor"),
        (dict(min_scale=0.0), "min_scale"),
        (dict(min_scale=2.0), "min_scale"),
        (dict(skip_nonfinite="yes"), "skip_nonfinite"),
    ],
)
def test_bad_input_raises_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=rf"^GradNormBackoff\({name}=.*\): allowed is "):
        GradNormBackoff(**kwargs)


def test_norm_of_float64_gradients_is_float64():
    """precision="64-true" (the matrix's reference for summation order) has float64 gradients: measured in float64."""
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    p.grad = torch.tensor([3.0, 4.0, 1e-12], dtype=torch.float64)
    norm = total_norm_fp32([p])
    assert norm.dtype == torch.float64 and norm.item() == math.sqrt(25.0 + 1e-24)


def _grads(dtypes: list[torch.dtype], seed: int = 0) -> list[nn.Parameter]:
    """Parameters of several shapes and magnitudes (1e-3 to 1e2) with gradients, and one without."""
    g = torch.Generator().manual_seed(seed)
    shapes, scales = [(7, 5), (13,), (1,), (64, 3)], [1e-3, 1.0, 30.0, 1e2]
    params = []
    for shape, scale, dtype in zip(shapes, scales, dtypes):
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=g) * scale).to(dtype)
        params.append(p)
    return params + [nn.Parameter(torch.zeros(3, dtype=dtypes[0]))]  # no gradient: ignored


@pytest.mark.parametrize("norm_type", [0.5, 1.0, 2.0, 3.0, math.inf])
@pytest.mark.parametrize("dtypes", ["fp32", "bf16", "fp32+bf16"])
def test_total_norm_fp32_is_the_float64_norm_of_all_gradients_concatenated(norm_type, dtypes):
    """bf16 gradients are measured in fp32 (a bf16 result would be off by up to 2^-9)."""
    f32, b16 = torch.float32, torch.bfloat16
    params = _grads({"fp32": [f32] * 4, "bf16": [b16] * 4, "fp32+bf16": [f32, b16, f32, b16]}[dtypes])
    ref = flat_norm([p.grad for p in params if p.grad is not None], norm_type)
    norm = total_norm_fp32(params, norm_type)
    assert norm.dtype == torch.float32 and norm.dim() == 0
    assert norm.item() == pytest.approx(ref, rel=1e-6, abs=0)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
@pytest.mark.parametrize("bad", ["inf", "-inf", "nan", "inf and nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_total_norm_fp32_of_non_finite_gradients_is_what_float64_gives(norm_type, bad, dtype):
    """Nothing is masked: an inf gives inf, a NaN gives NaN (also next to an inf, also for the max norm)."""
    params = _grads([dtype] * 4, seed=1)
    if "inf" in bad:
        params[1].grad[3] = -math.inf if bad == "-inf" else math.inf
    if "nan" in bad:
        params[3].grad[5, 1] = math.nan
    ref = flat_norm([p.grad for p in params if p.grad is not None], norm_type)
    norm = total_norm_fp32(params, norm_type).item()
    assert not math.isfinite(ref) and (norm == ref or (math.isnan(norm) and math.isnan(ref))), (norm, ref)


def test_total_norm_fp32_without_gradients_is_zero():
    assert total_norm_fp32([nn.Parameter(torch.ones(2))]).item() == 0.0 and total_norm_fp32([]).item() == 0.0
