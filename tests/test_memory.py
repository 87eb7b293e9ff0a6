"""Memory: the probes (RSS, its high-water mark, the node's free memory), the estimates of what training will still
allocate, and the fit check at setup; and that the sharder and MemoryMonitor read the same probe."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_horizon import HorizonStrategy
from lightning_horizon.callbacks import memory as monitor
from lightning_horizon.memory import (
    AVAILABLE_MEMORY_ENV,
    InsufficientMemoryError,
    current_rss,
    node_free_memory,
    optimizer_state_pending,
    probe,
    training_memory,
    reset_peak_rss,
)
from lightning_horizon.sharding import GraphSharder, ShardingConfig, resolve_budget
from lightning_horizon.sharding import sharder as sharder_module

_MIB = 2**20

# ---------------------------------------------------------------------- probes


def test_bad_available_memory_override_names_the_variable(monkeypatch):
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match=r"HORIZON_AVAILABLE_MEMORY='lots': must be an int >= 0 \(bytes"):
        node_free_memory()
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "12345")
    assert node_free_memory() == 12345


def test_memory_monitor_and_the_sharder_read_the_same_probe(monkeypatch):
    # one implementation: the callback and the sharder import the probe's functions, not their own
    for name in ("current_rss", "peak_rss"):
        assert getattr(monitor, name) is getattr(probe, name)
    for name in ("current_rss", "peak_rss", "reset_peak_rss"):
        assert getattr(sharder_module, name) is getattr(probe, name)
    assert monitor.node_free_memory is probe.node_free_memory

    # ... and the figures agree: a spike the sharder measures is the peak the monitor logs, and the sharder's
    # reset after the step lowers the monitor's peak with it
    from tests.scripts.sharding_models import tiny_gpt

    if not reset_peak_rss():
        pytest.skip("this kernel does not let the RSS high-water mark be reset")
    torch.manual_seed(0)
    model, batch = tiny_gpt(layers=2), tuple(torch.randint(0, 64, (2, 4, 16)))
    sharder = GraphSharder(ShardingConfig(budget=1 << 40, allocator_overhead=1.0, adaptive=False))
    sharder.maybe_plan(model, batch, 0)
    model.training_step(batch, 0).backward()
    spike = torch.ones(64 * _MIB // 4)  # 64 MiB, touched; large enough to go back to the OS when freed
    del spike
    seen = monitor.memory_now()["peak_rss_mib"] * _MIB
    assert seen >= current_rss() + 48 * _MIB
    sharder.after_step()
    assert seen <= sharder.last_peak < seen + 16 * _MIB
    assert monitor.memory_now()["peak_rss_mib"] * _MIB < sharder.last_peak - 32 * _MIB  # reset by the sharder
    sharder.uninstall()

    # the node's free memory: the monitor's "available" is the budget's free memory, override included
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, str(3 << 30))
    assert monitor.memory_now()["available_mib"] == 3 * 1024
    share = resolve_budget(ShardingConfig(budget=1.0))
    assert 3 << 30 < share <= current_rss() + (3 << 30)


# ---------------------------------------------------------------------- estimates


def test_optimizer_state_pending_counts_the_state_each_optimizer_will_allocate():
    w = torch.nn.Parameter(torch.zeros(10))  # 40 bytes
    assert optimizer_state_pending([torch.optim.SGD([w], lr=0.1)]) == 0
    assert optimizer_state_pending([torch.optim.SGD([w], lr=0.1, momentum=0.9)]) == 40
    assert optimizer_state_pending([torch.optim.RMSprop([w])]) == 40
    adam = torch.optim.AdamW([w])
    assert optimizer_state_pending([adam, torch.optim.Adam([w])]) == 160  # each optimizer keeps its own moments
    w.grad = torch.ones(10)
    adam.step()
    assert optimizer_state_pending([adam]) == 0  # allocated now: nothing pending


class _AdamWithPrevious(torch.optim.Adam):
    """A user's subclass: keeps the previous weights too, a per-element state no class name tells of."""

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        previous = {p: p.detach().clone() for g in self.param_groups for p in g["params"] if p.grad is not None}
        loss = super().step(closure)
        for p, w in previous.items():
            self.state[p]["previous"] = w
        return loss


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.RMSprop(ps, lr=0.01, centered=True, momentum=0.9),  # square_avg, grad_avg, momentum
    lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True),  # exp_avg, exp_avg_sq, max_exp_avg_sq
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0),  # none
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),  # momentum_buffer
    lambda ps: torch.optim.SGD([{"params": ps[:2]}, {"params": ps[2:], "momentum": 0.9}], lr=0.1),  # per group
    lambda ps: torch.optim.Adagrad(ps, lr=0.1),  # sum, made at construction
    lambda ps: _AdamWithPrevious(ps, lr=0.1),  # Adam's two moments and the subclass's own
], ids=["rmsprop-centered-momentum", "adam-amsgrad", "sgd", "sgd-momentum", "sgd-momentum-per-group", "adagrad",
        "adam-subclass"])
def test_optimizer_state_pending_is_what_a_real_step_creates(make):
    """Held now plus pending is, to the byte, the per-element state the optimizer holds after a real step: whatever
    the class, its groups' settings or a subclass's code; a frozen parameter gets none."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)
    opt = make(list(model.parameters()))

    def held() -> int:  # the moments and buffers (one entry per element); not the scalar step counters
        return sum(v.nbytes for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
                   and v.dim() > 0)

    before, pending = held(), optimizer_state_pending([opt])
    model(torch.randn(3, 6)).square().sum().backward()
    opt.step()
    assert before + pending == held()


def test_an_optimizer_that_cannot_step_a_copy_is_estimated_with_a_warning():
    w = torch.nn.Parameter(torch.zeros(10))
    with pytest.warns(UserWarning, match="cannot learn which state SparseAdam keeps .* counts 2 tensors"):
        assert optimizer_state_pending([torch.optim.SparseAdam([w])]) == 80  # dense gradients refused by its step


class _RecordState(L.Callback):
    """The setup check's estimate of the optimizer state (before the first step) and the state after it."""

    def on_train_start(self, trainer, pl_module):
        self.estimated = training_memory(pl_module, trainer.optimizers, trainer.precision_plugin)["optimizer_state"]

    def on_train_batch_end(self, trainer, *args):
        self.held = sum(v.nbytes for opt in trainer.optimizers for st in opt.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)


@pytest.mark.parametrize("precision", [None, ("bf16-true", "fp32"), ("bf16-true", "kahan")])
def test_the_setup_check_counts_the_state_in_the_dtype_the_precision_keeps_it(precision):
    """fp32 masters keep AdamW's moments in fp32 (8 bytes per bf16 weight's 2), Kahan in bf16: the setup check's
    estimate is the bytes the first step makes."""
    from lightning_horizon import HorizonPrecision
    from tests.scripts.fit import TinyLM, data

    record = _RecordState()
    plugins = [HorizonPrecision(precision[0], master=precision[1], compute="fp32")] if precision else []
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HorizonStrategy(threads_per_rank=1), max_steps=1,
                        plugins=plugins, callbacks=[record], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    model = TinyLM()
    trainer.fit(model, torch.utils.data.DataLoader(data(), batch_size=16))
    params = sum(p.numel() for p in model.parameters())
    assert record.estimated == record.held == params * (8 if precision in (None, ("bf16-true", "fp32")) else 4)


# ---------------------------------------------------------------------- the fit check


def test_model_that_cannot_fit_fails_at_setup_with_need_and_available(monkeypatch):
    from tests.scripts.fit import TinyLM, data

    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "10000")
    model = TinyLM()

    def trainer_():
        return L.Trainer(accelerator="cpu", devices=1, strategy=HorizonStrategy(threads_per_rank=1), max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)

    trainer = trainer_()
    with pytest.raises(InsufficientMemoryError) as info:
        trainer.fit(model, torch.utils.data.DataLoader(data(), batch_size=16))
    params = sum(p.numel() * 4 for p in model.parameters())
    message = str(info.value)
    assert f"needs an estimated {4 * params / 1024:.3g} KiB" in message  # weights + grads + AdamW's two moments
    assert f"parameters {params / 1024:.3g} KiB + gradients {params / 1024:.3g} KiB" in message
    assert "9.77 KiB is available to it (9.77 KiB free on the node / 1 rank(s)" in message
    assert trainer.global_step == 0 and model.losses == []  # before the first step
    # the same model with room: no error
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, str(1 << 30))
    trainer_().fit(TinyLM(), torch.utils.data.DataLoader(data(), batch_size=16))


def test_under_sharding_the_setup_check_still_runs_and_a_budget_the_node_cannot_give_fails(monkeypatch):
    """Sharding recomputes activations, not weights, gradients or optimizer state: the setup check runs with it too;
    and a byte budget above what this rank can have (its resident memory + its share of the free memory) fails at
    setup, naming the budget and what is available, instead of planning for memory that is not there."""
    from tests.scripts.fit import TinyLM, data

    def fit(sharding):
        model = TinyLM()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            strategy=HorizonStrategy(threads_per_rank=1, sharding=sharding))
        trainer.fit(model, torch.utils.data.DataLoader(data(), batch_size=16))
        return model, trainer

    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, str(1 << 20))  # 1 MiB free: the gradients and AdamW's state fit
    with pytest.raises(ValueError) as info:
        fit(ShardingConfig(budget=1 << 50))
    message = str(info.value)
    assert "ShardingConfig(budget=1125899906842624)" in message and "1 PiB" not in message
    assert "more than rank 0 (node 0) can have" in message and "1 MiB free on the node / 1 rank(s)" in message
    assert "a fraction (e.g. budget=0.9) or None (auto)" in message, message

    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "10000")  # as the check without sharding above: they cannot fit
    for sharding in ("auto", ShardingConfig(budget=1 << 50)):
        with pytest.raises(InsufficientMemoryError, match=r"cannot train this model, even with sharding: it needs"
                           r" an estimated .* but 9.77 KiB is available to it") as info:
            fit(sharding)
    assert "sharding='auto' recomputes" not in str(info.value)

    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, str(1 << 30))  # room, and a byte budget within it: trains
    model, trainer = fit(ShardingConfig(budget=current_rss() + (256 << 20), adaptive=False))
    assert trainer.global_step == 1 and trainer.strategy.sharder.plan is not None
