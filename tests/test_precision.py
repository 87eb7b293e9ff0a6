"""HorizonPrecision: dtypes per mode, fp32 accumulation, Kahan updates, loss parity, exact resume, skip = no-op.

Tiny models only (bf16 is emulated on some CPUs). No timing assertions: speed lives in recipes/bench_precision.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import types
from typing import Iterator, Optional

import pytest
import torch
import torch.optim.optimizer as optimizer_hooks
import torch.nn as nn
import torch.nn.functional as F

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning_horizon import HorizonStrategy, cpu
from lightning_horizon import precision as hp
from lightning_horizon.gradnorm import total_norm_fp32
from lightning_horizon.memory import bytes_per_param, held_bytes
from lightning_horizon.precision import HorizonPrecision

V, T, D = 32, 16, 32
#: what "auto" computes in on this CPU by its ISA alone: bf16 where it multiplies bf16 in hardware. The tests' models
#: are narrower than any width where bf16 wins, where "auto" computes in fp32: the modes below force the ISA's dtype so
#: that a native-bf16 CPU runs the bf16 compute path (test_auto_computes_narrow_matmuls_in_fp32 checks the width rule)
ISA_COMPUTE = cpu.resolve_compute("auto")[0]
MODES = {  # id -> constructor kwargs
    "bf16-mixed": dict(mode="bf16-mixed", compute=ISA_COMPUTE),
    "true-fp32": dict(mode="bf16-true", master="fp32", compute=ISA_COMPUTE),
    "true-kahan": dict(mode="bf16-true", master="kahan", compute=ISA_COMPUTE),
    "true-fp32-c32": dict(mode="bf16-true", master="fp32", compute="fp32"),
    "true-kahan-c32": dict(mode="bf16-true", master="kahan", compute="fp32"),
}


@pytest.fixture(autouse=True)
def _one_thread():
    # conftest restores the count afterwards; 2 OpenMP threads on 2 shared cores crawl when others run tests
    torch.set_num_threads(1)


def markov(n: int, seed: int = 1) -> torch.Tensor:
    """Sequences from a fixed random Markov chain with 4 successors per token (loss floor ln 4)."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, V, (V, 4), generator=torch.Generator().manual_seed(0))
    out = torch.empty(n, T + 1, dtype=torch.long)
    out[:, 0] = torch.randint(0, V, (n,), generator=g)
    for t in range(T):
        out[:, t + 1] = nxt[out[:, t], torch.randint(0, 4, (n,), generator=g)]
    return out


class TinyLM(L.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lr = lr
        self.emb = nn.Embedding(V, D)
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # tied: the fp32-compute upcast must keep the tie
        self.losses: list[float] = []
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.fc2(F.gelu(self.fc1(self.ln(h))))
        return self.head(h)

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        self.seen = {"weight_in_forward": self.fc1.weight.dtype, "logits": logits.dtype}
        loss = F.cross_entropy(logits.reshape(-1, V).float(), batch[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def trainer(plugin=None, steps: int = -1, callbacks=(), **kw) -> L.Trainer:
    kw.setdefault("enable_checkpointing", False)
    kw.setdefault("max_epochs", -1 if steps > 0 else 1)
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, plugins=[plugin] if plugin is not None else None,
                     callbacks=list(callbacks), **kw)


def loader(n: int = 64, batch: int = 8) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(markov(n), batch_size=batch)


def float64_norm(grads: list[torch.Tensor]) -> float:
    """The reference 2-norm: float64, over all gradients concatenated."""
    return torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads])).item()


def torch_clipped(grads: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """The reference clip: ``torch.nn.utils.clip_grad_norm_`` on an fp32 copy of ``grads``, in their dtype."""
    params = [nn.Parameter(torch.empty_like(g, dtype=torch.float32)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.detach().float().clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    return [p.grad.to(g.dtype) for p, g in zip(params, grads)]


def assert_clipped_like_torch(used: list[torch.Tensor], unclipped: list[torch.Tensor], max_norm: float) -> None:
    """``used`` (what the step used) is torch's clip of ``unclipped``: to fp32 rounding, or for bf16 grads to two
    bf16 roundings (a bf16 gradient times the clip factor is rounded to bf16, the reference is rounded once)."""
    assert float64_norm(unclipped) > max_norm  # a clip happened
    ref = torch_clipped(unclipped, max_norm)
    assert len(used) == len(ref)
    for u, r in zip(used, ref):
        rtol = 2.0**-7 if torch.bfloat16 in (u.dtype, r.dtype) else 1e-6
        torch.testing.assert_close(u.float(), r.float(), rtol=rtol, atol=0)


def snapshot(module, optimizer, plugin) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in module.state_dict().values()]
    out += [t.detach().clone() for t in plugin.training_state.extra_tensors()]
    out += [v.clone() for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


# ------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        (dict(mode="fp16-mixed"), ["mode='fp16-mixed'", "'bf16-mixed'", "'bf16-true'"]),
        (dict(mode="bf16-true", master="fp64"), ["master='fp64'", "'kahan'", "'fp32'"]),
        (dict(mode="bf16-mixed", master="fp32"), ["master='fp32'", "mode='bf16-mixed'", "'kahan'"]),
        (dict(mode="auto", master="kahan"), ["master='kahan'", "mode='auto'"]),
        (dict(compute="fp8"), ["compute='fp8'", "'auto'", "'bf16'", "'fp32'"]),
        (dict(backend="onednn"), ["backend='onednn'", "'native'", "'ipex'"]),
        (dict(mode="bf16-true", state_rounding="up"), ["state_rounding='up'", "'stochastic'", "'nearest'"]),
        (dict(mode="bf16-true", step_chunk_numel=0), ["step_chunk_numel=0", ">= 1"]),
    ],
)
def test_bad_input_names_parameter_value_and_allowed(kwargs, needles):
    with pytest.raises(ValueError) as err:
        HorizonPrecision(**kwargs)
    for needle in needles:
        assert needle in str(err.value)


# ------------------------------------------------------------------------------------------------ ISA policy


def test_auto_follows_the_isa_and_says_why(monkeypatch):
    # this machine: whatever it has, "auto" must match it and name the ISA
    plugin = HorizonPrecision()
    assert plugin.mode == "bf16-mixed"
    assert plugin.compute == ("bf16" if cpu.isa().native_bf16 else "fp32")
    assert f"ISA found: {cpu.isa().description}" in plugin.reason

    for var in cpu.ONEDNN_ISA_VARS:  # the CPUs below are described by their flags alone (no oneDNN cap here)
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))  # a Zen 3 / Haswell
    plugin = HorizonPrecision()
    assert plugin.compute == "fp32" and plugin.precision == "32-true"
    assert "no native bf16 -> fp32 compute; pass compute='bf16' to force" in plugin.reason
    forced = HorizonPrecision(compute="bf16")
    assert forced.compute == "bf16" and "forced" in forced.reason and "slower" in forced.reason

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert HorizonPrecision().compute == "bf16"
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16", "amx_tile"}))
    assert HorizonPrecision().compute == "bf16"


class Wide(L.LightningModule):
    """Two ``width``-wide Linear layers on random rows: the matmul width "auto" judges."""

    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.seen: Optional[torch.dtype] = None

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        out = self.net(batch)
        self.seen = out.dtype
        return out.float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_auto_computes_narrow_matmuls_in_fp32(monkeypatch):
    """Where bf16 is native, "auto" computes a model whose matmuls are narrower than where bf16 was measured to win
    in fp32 (bf16 is slower there), decided from the model at setup and said in the reason; wider ones in bf16;
    compute="bf16" still forces bf16."""
    for var in cpu.ONEDNN_ISA_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))  # an AMD Zen 4
    narrowest = cpu.BF16_MIN_WIDTH["AVX512-BF16"]
    # the FLOP-weighted smaller side of the weight matrices; an embedding table is a lookup, not a matmul
    assert hp.matmul_width(nn.Sequential(nn.Embedding(5000, 8), nn.Linear(32, 128), nn.Linear(128, 32))) == 32
    mixed = nn.Sequential(nn.Linear(64, 64), nn.Linear(512, 256))
    assert hp.matmul_width(mixed) == pytest.approx((64 * 64 * 64 + 512 * 256 * 256) / (64 * 64 + 512 * 256))
    assert hp.matmul_width(nn.Sequential(nn.ReLU())) is None
    for width, want in ((narrowest // 2, "fp32"), (narrowest, "bf16")):
        plugin, model = HorizonPrecision(), Wide(width)
        assert plugin.compute == "bf16"  # before setup, without a model: the ISA alone
        trainer(plugin, steps=1).fit(model, torch.utils.data.DataLoader(torch.randn(8, width), batch_size=8))
        assert plugin.compute == want and model.seen == (torch.bfloat16 if want == "bf16" else torch.float32)
        narrow = f"the model's matmuls are narrow (width {width} < {narrowest}"
        assert (narrow in plugin.reason) == (want == "fp32"), plugin.reason
    forced, model = HorizonPrecision(compute="bf16"), Wide(narrowest // 2)
    trainer(forced, steps=1).fit(model, torch.utils.data.DataLoader(torch.randn(8, narrowest // 2), batch_size=8))
    assert forced.compute == "bf16" and model.seen == torch.bfloat16


@contextlib.contextmanager
def precision_log() -> Iterator[list[logging.LogRecord]]:
    """The records of the precision's logger, INFO and up (a handler on it: the package may not propagate)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("lightning_horizon.precision")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def test_policy_logged_once_at_setup():
    with precision_log() as records:
        trainer(HorizonPrecision("auto"), steps=2).fit(TinyLM(), loader(16))
    lines = [r.getMessage() for r in records if "ISA found" in r.getMessage()]
    assert len(lines) == 1 and "HorizonPrecision(mode='bf16-mixed')" in lines[0]


# ------------------------------------------------------------------------------------------------ dtypes


class Grab(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        plugin = trainer.precision_plugin
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.group_dtypes = {p.dtype for p in params}
        self.grad_dtypes = {p.grad.dtype for p in params if p.grad is not None}
        self.module_grads = [p.grad for p in pl_module.parameters()]
        self.norm = plugin.last_grad_norm
        self.expected_norm = float64_norm([p.grad for p in params if p.grad is not None])


@pytest.mark.parametrize("name", list(MODES))
def test_dtypes_of_weights_grads_and_state(name):
    plugin, grab, model = HorizonPrecision(**MODES[name]), Grab(), TinyLM()
    tr = trainer(plugin, steps=3, callbacks=[grab])
    tr.fit(model, loader(32))
    opt = tr.optimizers[0]
    state_dtypes = {k: v.dtype for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor)}
    bf16_compute = plugin.compute == "bf16"
    assert model.seen["logits"] == (torch.bfloat16 if bf16_compute else torch.float32)
    assert grab.norm.dtype == torch.float32 and grab.norm.dim() == 0
    # the norm of what the step uses, ready for callbacks: fp32 (bf16 grads too) to fp32's rounding
    assert grab.norm.item() == pytest.approx(grab.expected_norm, rel=1e-6, abs=0)
    if name == "bf16-mixed":
        assert model.fc1.weight.dtype == torch.float32 and grab.grad_dtypes == {torch.float32}
        assert state_dtypes == {"step": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
        assert tr.precision == ("bf16-mixed" if bf16_compute else "32-true")
        return
    assert model.fc1.weight.dtype == torch.bfloat16 and tr.precision == "bf16-true"
    assert model.seen["weight_in_forward"] == (torch.bfloat16 if bf16_compute else torch.float32)
    if plugin.master == "fp32":
        # during the step the optimizer holds the fp32 masters and their fp32 grads (moved from the module)
        assert grab.group_dtypes == {torch.float32} and grab.grad_dtypes == {torch.float32}
        assert all(g is None for g in grab.module_grads)
        # between steps it holds the module's parameters (zero_grad, toggle_optimizer act on what backward fills)
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        assert held == {id(p) for p in model.parameters()}
        assert state_dtypes == {"step": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
        assert all(m.dtype == torch.float32 for m in plugin.training_state.extra_tensors())
    else:
        assert grab.group_dtypes == {torch.bfloat16} and grab.grad_dtypes == {torch.bfloat16}
        assert state_dtypes == {"step": torch.float32, "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}
        assert len(plugin.training_state.extra_tensors()) == 7
        assert all(c.dtype == torch.bfloat16 for c in plugin.training_state.extra_tensors())
        held = held_bytes(model, tr.optimizers, plugin)
        n = sum(p.numel() for p in model.parameters())
        assert bytes_per_param("bf16-true", "kahan")["total"] == 10  # 62.5% of fp32's 16
        assert 10 * n <= held["total"] <= 10 * n + 4 * 7  # + AdamW's 0-dim fp32 step per tensor


# ------------------------------------------------------------------------------------------------ numerics


class Accumulate(L.LightningModule):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def training_step(self, batch, _):
        return (self.w * batch[0][0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def on_before_optimizer_step(self, optimizer):
        self.grad = self.w.grad.detach().double().clone()


def test_fp32_gradient_accumulation_beats_bf16():
    """64 micro-batches: bf16-mixed accumulates in fp32 (rel. error < 1e-6), bf16-true in bf16 (> 1e-3)."""
    k, n = 64, 2048
    x = torch.rand(k, n, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).float()  # exact in bf16
    exact = x.double().sum(0) / k  # Lightning divides each micro-batch loss by k
    errors = {}
    for name in ("bf16-mixed", "true-kahan"):
        model = Accumulate(n)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=1)
        trainer(HorizonPrecision(**MODES[name]), steps=1, accumulate_grad_batches=k).fit(model, data)
        errors[name] = ((model.grad - exact).norm() / exact.norm()).item()
    assert errors["bf16-mixed"] < 1e-6, errors
    assert errors["true-kahan"] > 1e-3, errors
    assert errors["true-kahan"] > 1000 * errors["bf16-mixed"], errors


class Drift(L.LightningModule):
    """Every step moves each weight by -lr (grad 1): far below bf16's resolution at 1.0 (half-ulp 2e-3)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(64))

    def training_step(self, batch, _):
        return self.w.float().sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=2.5e-4)


def test_bf16_true_masters_keep_tiny_updates_that_naive_bf16_loses():
    steps, moved = 400, 400 * 2.5e-4  # 0.1 in all
    data = torch.utils.data.DataLoader(torch.zeros(steps, 1), batch_size=1)
    ref, naive = Drift(), Drift()
    trainer(steps=steps).fit(ref, data)
    trainer(steps=steps, precision="bf16-true").fit(naive, data)  # Lightning's plain bf16 weights
    fp32_move = 1.0 - ref.w.double()
    assert torch.allclose(fp32_move, torch.full_like(fp32_move, moved), rtol=1e-4)
    assert (1.0 - naive.w.double()).abs().max() < 0.1 * moved  # naive bf16 lost more than 90% of the movement
    for master, bound in (("kahan", 1e-2), ("fp32", 1e-6)):
        plugin, model = HorizonPrecision("bf16-true", master=master), Drift()
        trainer(plugin, steps=steps).fit(model, data)
        assert model.w.dtype == torch.bfloat16
        # the weight the master carries (bf16 + compensation, or the fp32 master) moved as fp32's did: Kahan
        # within 1%, the fp32 master by the very same fp32 updates (one rounding apart at most)
        true_w = plugin.training_state.read(model.w).double()
        assert ((1.0 - true_w) - fp32_move).abs().max() <= bound * moved, master
        assert (model.w.double() - ref.w.double()).abs().max() <= 2.0**-9, master  # bf16 weight: half an ulp


def test_the_strategy_hands_its_training_state_and_a_second_fit_keeps_the_masters():
    """HorizonStrategy owns the training state and hands it to the plugin; a plugin that meets a second strategy (a
    second Trainer) keeps its fp32 masters: the second fit continues from them, not from the rounded bf16 weight."""
    steps = 200
    data = torch.utils.data.DataLoader(torch.zeros(steps, 1), batch_size=1)
    ref = Drift()
    trainer(steps=2 * steps).fit(ref, data)
    plugin, model = HorizonPrecision("bf16-true", master="fp32"), Drift()
    for _ in range(2):
        strategy = HorizonStrategy()
        trainer(plugin, steps=steps, strategy=strategy).fit(model, data)
        assert plugin.training_state is strategy.training_state
    true_w = plugin.training_state.read(model.w).double()
    # the same fp32 updates as the fp32 fit (one rounding apart at most); from the bf16 weight: 2e-3 off
    assert (true_w - ref.w.double()).abs().max() <= 1e-7


def test_stochastic_state_rounding_lets_slow_averages_decay():
    """Adam's exp_avg_sq with beta2=0.999 and zero grads: v *= 0.999 per step, each step stored in bf16."""
    stored = {}
    for rounding in ("nearest", "stochastic"):
        plugin, v = HorizonPrecision("bf16-true", state_rounding=rounding), torch.ones(4096, dtype=torch.bfloat16)
        stochastic = plugin._policy.rounding  # the kahan policy's rounder
        for _ in range(300):
            stochastic.new_step()
            x = v.float() * 0.999
            v = x.to(torch.bfloat16) if rounding == "nearest" else stochastic(x)
        stored[rounding] = v.double().mean().item()
    assert stored["nearest"] == 1.0  # round-to-nearest never moves: 0.1% is below bf16's half-ulp
    assert abs(stored["stochastic"] - 0.999**300) < 0.01 * 0.999**300


def test_tiny_lm_ends_within_2_percent_of_fp32():
    steps, data = 120, loader(128, batch=8)
    ref = TinyLM()
    trainer(steps=steps).fit(ref, data)
    final = {}
    for name, kwargs in MODES.items():
        model = TinyLM()
        trainer(HorizonPrecision(**kwargs), steps=steps).fit(model, data)
        final[name] = sum(model.losses[-16:]) / 16
    fp32 = sum(ref.losses[-16:]) / 16
    assert fp32 < 0.7 * ref.losses[0]  # it learned something
    for name, loss in final.items():
        assert abs(loss - fp32) <= 0.02 * fp32, (name, loss, fp32)


# ------------------------------------------------------------------------------------------------ the step


class Skip(Callback):
    """At step ``at``: record everything, then set every grad in the optimizer's param groups to None."""

    def __init__(self, at: int) -> None:
        self.at, self.before, self.after = at, None, None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.at:
            self.before = snapshot(pl_module, optimizer, trainer.precision_plugin)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at + 1:  # the skipped step still counts as a step
            self.after = snapshot(pl_module, trainer.optimizers[0], trainer.precision_plugin)


@pytest.mark.parametrize("name", ["true-fp32", "true-kahan"])
def test_all_grads_none_in_callback_makes_the_step_a_no_op(name):
    skip = Skip(at=3)
    trainer(HorizonPrecision(**MODES[name]), steps=5, callbacks=[skip]).fit(TinyLM(), loader(64))
    assert skip.before is not None and skip.after is not None and len(skip.before) == len(skip.after)
    for a, b in zip(skip.before, skip.after):
        assert torch.equal(a, b)


class CountHooks(Callback):
    """Counts the optimizer's step hooks and torch's global ones (``register_optimizer_step_pre_hook``)."""

    def on_fit_start(self, trainer, pl_module):
        self.calls = {"pre": 0, "post": 0, "global pre": 0, "global post": 0}
        opt = trainer.optimizers[0]
        opt.register_step_pre_hook(lambda *a: self.count("pre"))
        opt.register_step_post_hook(lambda *a: self.count("post"))
        self.handles = [optimizer_hooks.register_optimizer_step_pre_hook(lambda *a: self.count("global pre")),
                        optimizer_hooks.register_optimizer_step_post_hook(lambda *a: self.count("global post"))]

    def count(self, key: str) -> None:
        self.calls[key] += 1

    def remove(self) -> None:
        for h in getattr(self, "handles", []):
            h.remove()


def test_chunked_kahan_step_is_identical_and_runs_hooks_once():
    models, hooks = [], []
    for chunk in (1 << 22, 100):  # one call vs. several chunks (the tied embedding alone is 1024 elements)
        model, count = TinyLM(), CountHooks()
        try:
            trainer(HorizonPrecision("bf16-true", step_chunk_numel=chunk), steps=6, callbacks=[count]).fit(model,
                                                                                                         loader())
        finally:
            count.remove()
        models.append(model)
        hooks.append(count.calls)
    assert hooks == [{"pre": 6, "post": 6, "global pre": 6, "global post": 6}] * 2
    for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()):
        assert torch.equal(a, b)


class StepGrads(Callback):
    """Per step: the gradients before the clip (callbacks run before it) and those the optimizer step used (a step
    post-hook: torch's optimizers leave the gradients as they are, and a pre-hook may run before Lightning's
    closure, i.e. before backward), both as the optimizer's param groups hold them."""

    def __init__(self) -> None:
        self.unclipped: list[list[torch.Tensor]] = []
        self.used: list[list[torch.Tensor]] = []

    def on_train_start(self, trainer, pl_module):
        for opt in trainer.optimizers:
            opt.register_step_post_hook(lambda o, *_: self.used.append(self.grads(o)))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.unclipped.append(self.grads(optimizer))

    @staticmethod
    def grads(opt) -> list[torch.Tensor]:
        return [p.grad.detach().clone() for g in opt.param_groups for p in g["params"] if p.grad is not None]


@pytest.mark.parametrize("name", ["true-fp32", "true-kahan", "bf16-mixed"])
def test_gradient_clipping_is_torchs_clip_of_the_fp32_pre_clip_norm(name):
    plugin, model, grads = HorizonPrecision(**MODES[name]), TinyLM(), StepGrads()
    tr = trainer(plugin, steps=2, gradient_clip_val=1e-3, callbacks=[grads])
    tr.fit(model, loader(16))
    assert plugin.last_grad_norm.dtype == torch.float32 and plugin.last_grad_norm > 1e-3
    assert len(grads.unclipped) == len(grads.used) == 2
    assert plugin.last_grad_norm.item() == pytest.approx(float64_norm(grads.unclipped[-1]), rel=1e-6)
    for unclipped, used in zip(grads.unclipped, grads.used):
        assert_clipped_like_torch(used, unclipped, 1e-3)


# ------------------------------------------------------------------------------------------------ checkpoints


class StateLM(TinyLM):
    """TinyLM with an optimizer whose state is more than per-element moments in the parameter's dtype."""

    OPTIMIZERS = {  # ASGD: fp32 0-dim eta and mu; Adafactor: fp32 factored row / column variances
        "AdamW": lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01),
        "ASGD": lambda ps, lr: torch.optim.ASGD(ps, lr=lr, t0=1),
        "Adafactor": lambda ps, lr: torch.optim.Adafactor(ps, lr=lr),
    }

    def __init__(self, optimizer: str, lr: float = 1e-2) -> None:
        super().__init__(lr)
        self.optimizer_name = optimizer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.OPTIMIZERS[self.optimizer_name](self.parameters(), self.lr)


@pytest.mark.parametrize("name, optimizer", [("true-kahan", "AdamW"), ("true-fp32", "AdamW"), ("true-kahan", "ASGD"),
                                             ("true-kahan", "Adafactor")])
def test_stop_and_resume_continues_bit_identically(name, optimizer, tmp_path):
    data = loader(48, batch=8)  # 6 steps per epoch; a checkpoint at each epoch end
    full = StateLM(optimizer)
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1)
    full_plugin = HorizonPrecision(**MODES[name])
    full_trainer = trainer(full_plugin, max_epochs=3, callbacks=[ckpt], enable_checkpointing=True,
                           gradient_clip_val=1.0)
    full_trainer.fit(full, data)
    resumed = StateLM(optimizer, lr=0.5)  # different lr and init: everything must come from the checkpoint
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)
    resumed.lr = full.lr
    plugin = HorizonPrecision(**MODES[name])
    tr = trainer(plugin, max_epochs=3, gradient_clip_val=1.0)
    tr.fit(resumed, data, ckpt_path=str(tmp_path / "epoch=0.ckpt"))
    assert resumed.losses == full.losses[6:]
    for a, b in zip(full.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    # every optimizer state tensor in the dtype it had (torch's load casts them all to the bf16 parameter's)
    full_state, res_state = full_trainer.optimizers[0].state_dict()["state"], tr.optimizers[0].state_dict()["state"]
    assert full_state.keys() == res_state.keys()
    for i, st in full_state.items():
        for k, v in st.items():
            r = res_state[i][k]
            assert (r.dtype, r.shape) == (v.dtype, v.shape) and torch.equal(r, v), (i, k, r.dtype, v.dtype)
    full_store, res_store = full_plugin.training_state.extra_tensors(), plugin.training_state.extra_tensors()
    assert len(full_store) == len(res_store)
    for a, b in zip(full_store, res_store):
        assert torch.equal(a, b)


def test_kahan_checkpoint_resumes_under_bf16_mixed_with_full_precision(tmp_path):
    data, ckpt = loader(16), ModelCheckpoint(dirpath=tmp_path, filename="last")
    kahan_plugin, model = HorizonPrecision("bf16-true"), TinyLM()
    trainer(kahan_plugin, max_epochs=1, callbacks=[ckpt], enable_checkpointing=True).fit(model, data)
    carried = {n: p.float() + kahan_plugin.training_state.compensation(p).float() for n, p in model.named_parameters()}
    mixed = TinyLM()
    trainer(HorizonPrecision("bf16-mixed"), max_epochs=1).fit(mixed, data, ckpt_path=str(tmp_path / "last.ckpt"))
    for n, p in mixed.named_parameters():  # nothing trains (max_epochs reached): weights are what was loaded
        assert torch.equal(p, carried[n]), n


# ------------------------------------------------------------------------------------------------ ipex


def _fallbacks(records: list[logging.LogRecord]) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in records if "using native torch" in r.getMessage()]


def test_ipex_absence_or_mismatch_falls_back_to_native_torch_with_a_warning(monkeypatch):
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", None)  # absent (None: the import raises)
    ipex, why = hp.ipex_status()
    assert ipex is None and "intel_extension_for_pytorch is not installed" in why
    model = TinyLM()
    with precision_log() as records:
        trainer(HorizonPrecision(backend="ipex"), steps=2).fit(model, loader(16))
    assert _fallbacks(records) == [(logging.WARNING, f"HorizonPrecision(backend='ipex'): using native torch: {why}")]
    assert len(model.losses) == 2  # and it trained natively

    from lightning_horizon.precision.ipex import ipex_optimize

    fake = types.ModuleType("intel_extension_for_pytorch")
    fake.__version__ = "1.13.0+cpu"  # no torch this project supports
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", fake)
    ipex, why = hp.ipex_status()
    assert ipex is None and f"1.13.0+cpu does not match torch {torch.__version__}" in why
    opts = [torch.optim.SGD(model.parameters(), lr=0.1)]
    for backend, level in (("ipex", logging.WARNING), ("auto", logging.INFO)):  # asked for: a warning
        with precision_log() as records:
            assert ipex_optimize(model, opts, backend, compatible=True, compute="bf16") is opts
        assert _fallbacks(records) == [(level, f"HorizonPrecision(backend={backend!r}): using native torch: {why}")]

    calls = []
    fake.__version__ = torch.__version__
    fake.optimize = lambda module, **kw: calls.append(kw) or (module, kw["optimizer"])
    model = TinyLM()
    trainer(HorizonPrecision(backend="auto", compute="bf16"), steps=2).fit(model, loader(16))
    assert len(calls) == 1 and calls[0]["weights_prepack"] is True and "dtype" not in calls[0]
    assert len(model.losses) == 2
    # fp32 compute (a CPU without native bf16): "auto" stays native, where IPEX measured no faster; "ipex" applies it
    for backend, applied, level in (("auto", 1, logging.INFO), ("ipex", 2, None)):
        with precision_log() as records:
            trainer(HorizonPrecision(backend=backend, compute="fp32"), steps=1).fit(TinyLM(), loader(8))
        assert len(calls) == applied
        assert [lv for lv, _ in _fallbacks(records)] == ([level] if level else [])


# ------------------------------------------------------------------------------------------------ DDP

DDP_SCRIPT = """
import torch, lightning.pytorch as L
from tests.test_precision import TinyLM, loader, MODES
from lightning_horizon.precision import HorizonPrecision

def main(out_prefix):
    torch.set_num_threads(1)
    out = {}
    for name in ("true-kahan", "true-kahan-c32", "true-fp32-c32"):
        model, plugin = TinyLM(), HorizonPrecision(**MODES[name])
        tr = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=False,
                       enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                       plugins=[plugin])
        tr.fit(model, loader(64))
        out[name] = [*model.state_dict().values(), *plugin.training_state.extra_tensors()]
    torch.save(out, out_prefix + f".rank{tr.global_rank}")
"""


def test_ddp_ranks_stay_identical(tmp_path):
    """2 gloo ranks: grads all-reduced every step (a param whose dtype changes loses DDP's hooks) -> equal ranks.

    Lightning's "ddp" in 2 ranks forked after one launch's imports (tests/launch.py's ``run_worlds``)."""
    from tests.launch import REPO, assert_exited, run_worlds

    script = tmp_path / "ddp_precision.py"
    script.write_text(DDP_SCRIPT)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # the script imports tests.*
    job = {"tag": "ddp", "call": f"{script}:main", "args": [str(tmp_path / "out")], "devices": 2,
           "env": {"OMP_NUM_THREADS": "1"}}
    ended, _ = run_worlds([job], tmp_path / "launch", timeout=180, env={"PYTHONPATH": path})
    assert_exited(ended, "ddp", [0, 0])
    ranks = [torch.load(tmp_path / f"out.rank{r}") for r in (0, 1)]
    for name in ranks[0]:
        assert len(ranks[0][name]) > 7
        for a, b in zip(ranks[0][name], ranks[1][name]):
            assert torch.equal(a, b), name


# ------------------------------------------------------------------------------------- composition defects


class TwoOptimizers(L.LightningModule):
    """GAN-style manual optimization: loss 1 steps ``a`` only, loss 2 steps ``b`` only (plain SGD, lr 1).

    Loss 1 = 1000 * a * b gives ``b`` a gradient of 1000 that must not reach the second step: ``toggle_optimizer``
    freezes ``b`` during it and ``zero_grad`` clears what is left. Loss 2 = 2 * b: b must move by exactly -2.
    All values are exact in bf16, so every mode must end with the same weights.
    """

    def __init__(self, clip: float | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.zeros(4))
        self.clip = clip
        self.unclipped: list[list[torch.Tensor]] = []  # a's gradient before each clip

    def training_step(self, batch: torch.Tensor, _: int) -> None:
        opt_a, opt_b = self.optimizers()
        self.toggle_optimizer(opt_a)
        self.manual_backward(1000 * (self.a * self.b + self.a).sum() + 0 * batch.sum())
        if self.clip is not None:
            self.unclipped.append(StepGrads.grads(opt_a))  # the optimizer's: under compute="fp32" self.a is a copy
            self.clip_gradients(opt_a, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt_a.step()
        opt_a.zero_grad()
        self.untoggle_optimizer(opt_a)
        self.toggle_optimizer(opt_b)
        self.manual_backward(2 * self.b.sum())
        opt_b.step()
        opt_b.zero_grad()
        self.untoggle_optimizer(opt_b)

    def configure_optimizers(self):
        return torch.optim.SGD([self.a], lr=1e-3), torch.optim.SGD([self.b], lr=1.0)


@pytest.mark.parametrize("name", ["bf16-mixed", "true-fp32-c32", "true-kahan-c32"])
def test_manual_two_optimizers_toggle_and_zero_grad_act_on_what_backward_fills(name):
    model = TwoOptimizers()
    # manual optimization counts every optimizer step: 4 steps = 2 batches
    trainer(HorizonPrecision(**MODES[name]), steps=4).fit(model, torch.utils.data.DataLoader(torch.zeros(4, 1)))
    # a: steps of -1e-3 * 1000 * (b + 1) with b = 0 then -2 (1 -> 0 -> 1); b: two steps of exactly -2, no leak
    assert torch.equal(model.b.detach().float(), torch.full((4,), -4.0)), model.b
    assert torch.allclose(model.a.detach().float(), torch.ones(4), atol=1e-2), model.a


@pytest.mark.parametrize("name", ["bf16-mixed", "true-fp32-c32", "true-kahan-c32"])
def test_manual_clip_gradients_clips_what_the_step_uses(name):
    model, grads = TwoOptimizers(clip=1e-3), StepGrads()
    trainer(HorizonPrecision(**MODES[name]), steps=4, callbacks=[grads]).fit(
        model, torch.utils.data.DataLoader(torch.zeros(4, 1)))
    # every step of optimizer a used torch's clip of its gradient (unclipped: 2000 and more)
    assert len(grads.used) == 4 and len(model.unclipped) == 2
    for unclipped, used in zip(model.unclipped, grads.used[0::2]):
        assert_clipped_like_torch(used, unclipped, 1e-3)


class OwnListSGD(torch.optim.Optimizer):
    """An optimizer that steps its own list of parameters instead of reading param_groups at step time."""

    def __init__(self, params, lr: float = 0.1) -> None:
        self.params = list(params)
        super().__init__(self.params, dict(lr=lr))

    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        with torch.no_grad():
            self._update()

    def _update(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.defaults["lr"])


@pytest.mark.parametrize("master", ["fp32", "kahan"])
def test_bf16_true_refuses_an_optimizer_with_its_own_parameter_list(master):
    model = TinyLM()
    model.configure_optimizers = lambda: OwnListSGD(model.parameters())
    with pytest.raises(ValueError, match=r"bf16-true.*OwnListSGD.*OwnListSGD\.params.*bf16-mixed"):
        trainer(HorizonPrecision("bf16-true", master=master, compute="fp32"), steps=1).fit(model, loader(8))
    # bf16-mixed steps the module's own parameters: any optimizer works
    model = TinyLM()
    before = model.fc1.weight.detach().clone()
    model.configure_optimizers = lambda: OwnListSGD(model.parameters())
    trainer(HorizonPrecision("bf16-mixed", compute="fp32"), steps=1).fit(model, loader(8))
    assert not torch.equal(before, model.fc1.weight)


def test_bf16_true_refuses_zero_redundancy_optimizer(monkeypatch):
    from lightning.fabric.plugins.environments.lightning import find_free_network_port
    from torch.distributed.optim import ZeroRedundancyOptimizer

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_network_port()))  # a fixed port clashes with a parallel run
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)  # conftest destroys it
    model = TinyLM()
    model.configure_optimizers = lambda: ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    with pytest.raises(ValueError, match=r"bf16-true.*ZeroRedundancyOptimizer"):
        trainer(HorizonPrecision("bf16-true", compute="fp32"), steps=1).fit(model, loader(8))


class SkipsABatch(TinyLM):
    """Returns None (a skipped batch) at batch 2; records the lr between steps, where no scale may be applied."""

    def __init__(self) -> None:
        super().__init__(lr=0.025)
        self.lrs: list[float] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 2 else loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("name", ["bf16-mixed", "true-fp32-c32", "true-kahan-c32"])
def test_a_skipped_batch_leaves_no_backoff_scale_on_the_scheduler_lr(name):
    from lightning_horizon import GradNormBackoff

    model = SkipsABatch()
    backoff = GradNormBackoff(max_norm=None, spike_threshold=1e-9, factor=0.5)  # every step a spike: scale < 1
    trainer(HorizonPrecision(**MODES[name]), steps=5, callbacks=[backoff]).fit(model, loader(40))
    import math

    cosine = [0.025 * (1 + math.cos(math.pi * t / 4)) / 2 for t in range(5)]
    assert model.lrs == pytest.approx(cosine, rel=1e-6), model.lrs
    assert backoff.lr_scale < 1


class SeesInputs(TinyLM):
    """Records what training_step receives: the batch's dtypes and the default dtype."""

    def training_step(self, batch, batch_idx):
        tokens, weights = batch
        self.seen_inputs = (tokens.dtype, weights.dtype, torch.get_default_dtype())
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V).float(), tokens[:, 1:].reshape(-1), reduction="none")
        return (loss * weights.float().repeat_interleave(T)).mean()


@pytest.mark.parametrize("kwargs, expected", [
    (dict(mode="bf16-true", compute="bf16"), (torch.long, torch.bfloat16, torch.bfloat16)),  # = Lightning's bf16-true
    (dict(mode="bf16-true", compute="fp32"), (torch.long, torch.float32, torch.float32)),
    (dict(mode="bf16-mixed", compute="bf16"), (torch.long, torch.float32, torch.float32)),
])
def test_bf16_true_casts_float_inputs_and_default_dtype_only_with_bf16_compute(kwargs, expected):
    model = SeesInputs()
    data = torch.utils.data.TensorDataset(markov(8), torch.rand(8))
    trainer(HorizonPrecision(**kwargs), steps=1).fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    assert model.seen_inputs == expected
    assert torch.get_default_dtype() == torch.float32  # nothing leaks out of the step


@pytest.mark.skipif(hp.ipex_status()[0] is None,
                    reason="needs intel_extension_for_pytorch with its own torch: `bash .ci/ipex` builds that environment")
def test_ipex_for_real_trains_like_native_torch():
    """With IPEX installed (bash .ci/ipex): backend="ipex" applies ipex.optimize (prepacked weights, its fused
    AdamW) and trains the same model, tied embedding included, to native torch's losses within bf16 rounding."""
    losses, lines = {}, {}
    for backend in ("native", "ipex"):
        model = TinyLM()
        with precision_log() as records:
            trainer(HorizonPrecision("bf16-mixed", backend=backend), steps=8).fit(model, loader(64))
        losses[backend], lines[backend] = torch.tensor(model.losses), [r.getMessage() for r in records]
        assert model.head.weight is model.emb.weight  # the tie survives the rewrite
    ipex = hp.ipex_status()[0]
    assert f"HorizonPrecision: ipex {ipex.__version__} optimize(weights_prepack=True)" in lines["ipex"]
    assert not any("ipex" in m for m in lines["native"])
    torch.testing.assert_close(losses["ipex"], losses["native"], rtol=2e-2, atol=0)
    assert losses["ipex"][-1] < losses["ipex"][0] - 0.5  # it learns
