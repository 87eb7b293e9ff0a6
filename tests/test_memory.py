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
    assert optimizer_state_pending([adam, torch.optim.Adam([w])]) == 80  # a parameter is counted once
    w.grad = torch.ones(10)
    adam.step()
    assert optimizer_state_pending([adam]) == 0  # allocated now: nothing pending


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
