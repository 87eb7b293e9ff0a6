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
