import pytest

from lightning_horizon import cpu
from lightning_horizon.precision import resolve_compute


def test_plan_cores_disjoint_contiguous_slices():
    cores = list(range(10))
    slices = [cpu.plan_cores(r, 3, cores) for r in range(3)]
    assert [s for s, _ in slices] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert not any(shared for _, shared in slices)


def test_plan_cores_shares_round_robin_when_ranks_exceed_cores():
    plans = [cpu.plan_cores(r, 4, [0, 1]) for r in range(4)]
    assert plans == [([0], True), ([1], True), ([0], True), ([1], True)]


def test_plan_cores_slices_stay_inside_numa_domains_when_ranks_divide_them(monkeypatch):
    monkeypatch.setattr(cpu, "numa_domains", lambda: {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]})
    monkeypatch.setattr(cpu, "_START_AFFINITY", frozenset(range(8)))
    cores = cpu.available_cores()
    assert cores == [0, 1, 4, 5, 2, 3, 6, 7]
    assert [cpu.plan_cores(r, 2, cores)[0] for r in range(2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_isa_is_consistent_with_torch(monkeypatch):
    for var in cpu.ONEDNN_ISA_VARS:
        monkeypatch.delenv(var, raising=False)
    found = cpu.isa()
    assert found.native_bf16 == (found.avx512_bf16 or found.amx or found.arm_bf16)
    if found.torch_capability.startswith("AVX512"):
        assert found.avx512
    assert found.name in ("AMX", "AVX512-BF16", "AVX-512", "AVX2", "baseline")


def test_isa_without_proc_cpuinfo_asks_torchs_probe(monkeypatch):
    """Where there is no /proc/cpuinfo, torch's cpuinfo probe tells AVX512-BF16: the answer the flags give here."""
    flags = cpu.cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset())
    assert cpu.isa().avx512_bf16 == ("avx512_bf16" in flags)


def test_onednn_isa_cap_below_bf16_means_no_native_bf16(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert cpu.isa().native_bf16
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")  # how a CPU without bf16 is reproduced on one with it
    assert not cpu.isa().native_bf16 and "oneDNN capped at AVX2" in cpu.isa().description
    compute, reason = resolve_compute("auto")  # HorizonPrecision("auto") follows it
    assert compute == "fp32" and "oneDNN capped at AVX2" in reason
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert cpu.isa().native_bf16


def test_cpulist_parsing():
    assert cpu.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


# ------------------------------------------------------------------ malloc keeps what a step frees

_KEEP_SCRIPT = r"""
import json, resource, sys
import lightning as L, torch
from lightning_horizon import HorizonStrategy
from tests.scripts.fit import TinyLM, data

def faults():  # minor page faults of the last 3 of 5 rounds of a 64 MiB tensor allocated, written and freed
    counts = []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(16 << 20)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sum(counts[2:])

class During(L.Callback):
    def on_train_start(self, trainer, pl_module):
        out["during"].append(faults())

out = {"before": faults(), "during": [], "after": [], "tables": []}
for kwargs in ({}, {"sharding": "auto"}, {"keep_freed_memory": False}):
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HorizonStrategy(**kwargs), max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[During()])
    trainer.fit(TinyLM(), torch.utils.data.DataLoader(data(), batch_size=16))
    out["tables"].append(trainer.strategy.startup_table().splitlines()[0])
    out["after"].append(faults())
print("RESULT", json.dumps(out))
"""


def test_glibc_malloc_keeps_freed_memory_during_fit_only_and_never_under_sharding_or_when_configured():
    """The promise itself: memory a step frees is reallocated without page faults during fit (a 64 MiB tensor is
    16,384 pages: glibc's defaults mmap it afresh every time), glibc's behaviour again after fit; sharding (its
    budget measures RSS) and ``keep_freed_memory=False`` leave malloc alone; a user's own malloc setting wins."""
    import json
    import os
    import subprocess
    import sys

    if cpu.allocator() is not None or cpu._glibc_malloc() is None:
        pytest.skip("malloc here is not glibc's, or is configured by the environment")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    run = subprocess.run([sys.executable, "-c", _KEEP_SCRIPT], capture_output=True, text=True, timeout=240,
                         env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads(run.stdout.split("RESULT ", 1)[1])
    pages = 3 * (64 << 20) // 4096
    assert out["before"] > 0.9 * pages  # glibc's defaults: every round faults the tensor in again
    kept, sharded, off = out["during"]
    assert kept < 0.02 * pages, out
    assert sharded > 0.9 * pages and off > 0.9 * pages, out
    assert all(after > 0.9 * pages for after in out["after"]), out  # teardown gave glibc's thresholds back
    assert out["tables"][0].endswith("allocator glibc malloc, keeps freed memory")
    assert all(t.endswith("allocator glibc malloc") for t in out["tables"][1:]), out["tables"]
    # a user's own setting wins: nothing is changed
    code = "from lightning_horizon import cpu; print('KEPT', cpu.keep_freed_memory())"
    for var, value in (("MALLOC_TRIM_THRESHOLD_", str(1 << 20)),
                       ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1048576")):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**env, var: value})
        assert "KEPT False" in run.stdout, (var, run.stdout + run.stderr)


# ---------------------------------------------------------------------------------------------- startup lines


def test_allocator_hint_once_per_machine(tmp_path, monkeypatch):
    from lightning_horizon import placement

    monkeypatch.setenv("HORIZON_LAYOUT_CACHE", str(tmp_path / "cache" / "layouts.json"))
    if cpu.allocator() is not None:
        assert not placement.allocator_hint_due()  # jemalloc or tcmalloc loaded: nothing to hint at
        return
    assert [placement.allocator_hint_due() for _ in range(3)] == [True, False, False]
    assert (tmp_path / "cache" / "allocator-hint-shown").exists()


def _rows(threads, cores, shared=False):
    return [{"rank": r, "node": 0, "local_rank": r, "cores": c, "threads": t, "shared": shared, "host": "h",
             "pid": 1, "keeps_freed_memory": False} for r, (t, c) in enumerate(zip(threads, cores))]


def test_more_threads_than_cores_is_warned_naming_the_option_and_the_cores(caplog, tmp_path, monkeypatch):
    import logging

    from lightning_horizon import placement
    from lightning_horizon.topology import Topology

    monkeypatch.setenv("HORIZON_LAYOUT_CACHE", str(tmp_path / "layouts.json"))
    with caplog.at_level(logging.WARNING, logger="lightning_horizon.strategy"):
        placement.report(Topology(1, 0, 1), _rows([4], [[0, 1]]), "gloo", 1, threads_per_rank=4)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "HorizonStrategy(threads_per_rank=4): rank 0 runs 4 threads on 2 cores (0-1)" \
        in warned[0] and "threads_per_rank=None" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_horizon.strategy"):
        placement.report(Topology(2, 0, 2), _rows([1, 1], [[0], [1]]), "gloo", 2, threads_per_rank=1)
        placement.report(Topology(1, 0, 1), _rows([2], [[0, 1]]), "gloo", 1)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]  # a thread per core: nothing to say


def test_the_cache_probe_closes_its_files():
    import warnings

    from lightning_horizon.layout.rule import l2_per_core

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        l2_per_core()
        import gc

        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
