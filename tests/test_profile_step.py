"""recipes/profile_step.py: the category mapping (fake events) and a smoke run of the script (tiny.yaml, 2 warm-up +
2 profiled steps, one rank: in this process, as a process start + ``import lightning`` costs seconds on 2 cores;
pytest-timeout bounds it)."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from tests.launch import REPO

sys.path.insert(0, str(REPO / "recipes"))

import profile_step  # noqa: E402


def _chain(*names: str) -> SimpleNamespace:
    """The innermost of nested fake profiler events, outermost first."""
    parent = None
    for name in names:
        parent = SimpleNamespace(name=name, cpu_parent=parent)
    return parent


@pytest.mark.parametrize("names, row", [
    # Lightning runs the closure inside optimizer.step: the closure marker ends the optimizer region
    (("Optimizer.step#AdamW.step", profile_step.MARK, "DistributedDataParallel.forward", "aten::linear", "aten::addmm"),
     "matmul"),
    (("Optimizer.step#AdamW.step", profile_step.MARK, "aten::linear", "aten::t"), "matmul"),
    (("Optimizer.step#AdamW.step", "aten::_fused_adamw_"), "optimizer step"),
    (("Optimizer.step#AdamW.step", "aten::mul_"), "optimizer step"),  # grad-norm clipping: the step region
    (("Optimizer.step#AdamW.step", profile_step.MARK, "Optimizer.zero_grad#AdamW.zero_grad"), "optimizer step"),
    ((profile_step.MARK, "autograd::engine::evaluate_function: AddmmBackward0", "AddmmBackward0", "aten::sum"),
     "matmul"),
    ((profile_step.MARK, "aten::scaled_dot_product_attention",
      "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::empty"), "attention"),
    ((profile_step.MARK, "autograd::engine::evaluate_function: NativeLayerNormBackward0"), "layer norm"),
    ((profile_step.MARK, "aten::cross_entropy_loss", "aten::log_softmax"), "softmax / cross-entropy"),
    ((profile_step.MARK, "aten::gelu"), "elementwise / GELU"),
    ((profile_step.MARK, "aten::add"), "elementwise / GELU"),
    ((profile_step.MARK, "aten::where", "aten::broadcast_tensors"), "elementwise / GELU"),  # not a collective
    ((profile_step.MARK, "aten::embedding", "aten::index_select"), "other ops"),
    ((profile_step.MARK, "autograd::engine::evaluate_function: AddmmBackward0", "c10d::allreduce_"),
     "gradient sync"),
    ((profile_step.MARK, "c10d::broadcast_"), "gradient sync"),
    (("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "aten::stack"), "data loading"),
    ((profile_step.MARK, profile_step.BACKWARD, "autograd::engine::evaluate_function: MmBackward0", "aten::mm"),
     "matmul"),
    ((profile_step.MARK,), None),  # the closure's own time: overhead
    ((profile_step.MARK, profile_step.BACKWARD), None),  # the autograd engine, the wait for the last allreduce
    ((profile_step.MARK, "DistributedDataParallel.forward"), None),  # a Python scope's own time: overhead
])
def test_categorize(names, row):
    assert profile_step.categorize(_chain(*names)) == row


def test_profile_step_smoke(tmp_path, capsys):
    returned = profile_step.main(["--smoke", "--threads-per-rank", "1", "--json", str(tmp_path / "p.json"),
                                  "--trace", str(tmp_path / "trace.json"), "--gemms"])
    out = capsys.readouterr().out
    assert "tiny.yaml | global batch 8 x 64 tokens | 1 rank(s) x 1 thread(s)" in out and "2 warm-up + 2 profiled" in out
    res = json.loads((tmp_path / "p.json").read_text())
    assert res == json.loads(json.dumps(returned))  # the JSON is what main returns
    share = res["rows_share"]
    assert set(share) == set(profile_step.ROWS)
    assert abs(sum(share.values()) - 1) < 0.02  # the rows cover the step time, no more
    assert share["other / Python overhead"] > -0.02  # negative: something was counted twice
    assert all(v >= 0 for r, v in share.items() if r != "other / Python overhead")
    ms = res["rows_ms_per_step"]
    assert ms["matmul"] > 0 and ms["optimizer step"] > 0 and res["adamw_kernels_s"] > 0
    assert res["threads"] == 1 and res["optimizer_impl"] == "fused" and 0 < res["mfu"] < 10
    for row in ("| matmul ", "| optimizer step ", "| other / Python overhead ", "MFU"):
        assert row in out
    assert (tmp_path / "trace.json").stat().st_size > 1000
    # --gemms: tiny.yaml's Linear shapes (qkv, attention proj, mlp fc and proj; the head is 64 x 256 as the fc),
    # three GEMMs each, at a rank's tokens
    shapes = {(r["in"], r["out"]): r["layers"] for r in res["gemms"]}
    assert shapes == {(64, 192): 2, (64, 64): 2, (64, 256): 3, (256, 64): 2} and len(res["gemms"]) == 12
    assert [r["gemm"] for r in res["gemms"][:3]] == list(profile_step.GEMMS)
    assert all(r["flops"] == 2 * 8 * 64 * r["in"] * r["out"] and r["seconds"] > 0 for r in res["gemms"])
    assert 0 < res["gemms_share_of_peak"] < 10
    assert f"weight GEMMs alone ({res['compute']}, 1 thread(s), 512 tokens per rank)" in out


def test_breakdown_sums_to_the_window_and_counts_the_backward_wait_as_sync_with_ranks():
    def ev(name, parent=None, ms=0.0, thread=1):
        return SimpleNamespace(name=name, cpu_parent=parent, self_cpu_time_total=1e3 * ms, thread=thread)

    step = ev("Optimizer.step#AdamW.step", ms=3)
    closure = ev(profile_step.MARK, step, ms=2)
    backward = ev(profile_step.BACKWARD, closure, ms=5)
    events = [step, closure, backward, ev("aten::mm", backward, ms=20), ev("aten::_fused_adamw_", step, ms=4),
              ev("gloo:all_reduce", ms=7, thread=2)]  # another thread: listed, not summed
    for world, sync in ((1, 0.0), (2, 5.0)):
        rows, details = profile_step.breakdown(events, 0.050, world)
        assert list(rows) == list(profile_step.ROWS) and sum(rows.values()) == pytest.approx(0.050)
        assert rows["matmul"] == pytest.approx(0.020) and rows["optimizer step"] == pytest.approx(0.007)
        assert rows["gradient sync"] == pytest.approx(sync / 1e3)
        assert rows["other / Python overhead"] == pytest.approx(0.050 - 0.027 - sync / 1e3)
        assert details["adamw_kernels_s"] == pytest.approx(0.004) and "gloo:all_reduce" in details["other_threads"]


def test_fastest_call_warms_up_then_keeps_the_fastest():
    """The GEMM rows and the matmul peak take the fastest call after a warm-up call, of at least ``calls`` calls and
    as many more as ``seconds`` allow."""
    import time

    from lightning_horizon.callbacks import fastest_call

    naps = [0.2, 0.05, 0.0, 0.05]  # the warm-up call is the slowest; it must not count, nor the later slow ones
    seen = []

    def nap():
        seen.append(naps[len(seen)] if len(seen) < len(naps) else 0.01)
        time.sleep(seen[-1])

    assert fastest_call(nap, calls=3) < 0.04 and len(seen) == 4
    seen.clear()
    naps = [0.0] + [0.01] * 100
    assert 0.01 <= fastest_call(nap, calls=1, seconds=0.1) and len(seen) >= 3  # calls=1 alone: 2
