"""The bench recipes' smoke runs, part one: bench_vs_lightning (its layout arms, the lockstep mode, the per-path
summary), bench_node's stages, bench_collectives, bench_precision and bench_sharding, at tiny settings.

Split from tests/test_recipes.py (which keeps the recipes end to end and the other benches' smoke runs) so that
``--dist loadfile`` can give the two halves to the two workers: each bench smoke starts its arms in fresh processes,
and in one module they made the suite's longest. In-process where possible: a bench's driver runs here and starts
its arms in worker processes of their own, which it kills on its ``--timeout`` (pytest-timeout bounds the whole).
"""

from __future__ import annotations

import math
import re
import signal
import sys

import pytest

from tests.launch import REPO

sys.path.insert(0, str(REPO / "recipes"))

import pretrain_gpt  # noqa: E402


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus_cache")


@pytest.fixture
def bench_here():
    """A bench driver run in this process makes SIGTERM an exception (to kill its workers' groups): undone after."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


def test_bench_smoke(tmp_path, cache_dir, monkeypatch, capfd, bench_here):
    """A layout arm (Lightning's default layout: one process on both cores) against the tuned arm (an empty layout
    cache: the rule's layout), --smoke (tiny.yaml, 1 + 3 steps, one round), on the AVX2 path (--paths: the driver
    runs itself in a child with oneDNN capped, each arm a worker of that child), then the per-path summary."""
    import bench_vs_lightning

    monkeypatch.setenv("HORIZON_LAYOUT_CACHE", str(tmp_path / "no_layouts.json"))  # the workers inherit it
    bench_vs_lightning.main(["--smoke", "--layouts", "1x2", "--layout-arms", "lightning-32", "--timeout", "120",
                             "--cache-dir", str(cache_dir), "--paths", "avx2", "--json", str(tmp_path / "b.json")])
    out = capfd.readouterr().out
    assert "== path avx2 (ONEDNN_MAX_CPU_ISA=AVX2)" in out and "(oneDNN capped at AVX2), native bf16: no" in out
    assert "| 1 warm-up + 3 measured steps | 1 round(s) |" in out and "configs/tiny.yaml" in out
    assert "| lightning-32@1x2 " in out and "| horizon-tuned " in out and "MFU" in out
    assert "vs Lightning default" in out and "Lightning default: lightning-32@1x2" in out
    tuned = re.search(r"horizon-tuned: (\d+)x(\d+) \(rule: ", out)
    assert tuned, out[-2000:]
    pairs = re.search(r"horizon-tuned / lightning-32@1x2 per round: ([\d.]+)$", out, re.M)
    import json

    rows = {r["arm"]: r for r in json.loads((tmp_path / "b.json").read_text())["paths"]["avx2"]["rows"]}
    assert all(r["tokens_per_sec"] > 0 and math.isfinite(r["final_loss"]) for r in rows.values())
    assert (rows["lightning-32@1x2"]["procs"], rows["lightning-32@1x2"]["threads"]) == (1, 2)
    assert (rows["horizon-tuned"]["procs"], rows["horizon-tuned"]["threads"]) == tuple(map(int, tuned.groups()))
    # the same seed and global batch on every layout: the same training, whatever the split
    assert rows["horizon-tuned"]["final_loss"] == pytest.approx(rows["lightning-32@1x2"]["final_loss"], rel=1e-3)
    # one round: its pair is the ratio of the two arms' tokens/s; the path's row says it, with fp32 MFU (no bf16)
    ratio = rows["horizon-tuned"]["rounds"][0] / rows["lightning-32@1x2"]["rounds"][0]
    assert pairs and float(pairs.group(1)) == pytest.approx(ratio, abs=0.006), out[-2000:]
    row = re.search(r"^\| avx2 \| lightning-32@1x2 [\d,]+ tok/s \| horizon-tuned [\d,]+ tok/s \| ([\d.]+)x \|"
                    r" ([\d.]+) \| \d+% of fp32 \| \d+% of fp32 \|$", out, re.M)
    assert row and float(row.group(2)) == float(pairs.group(1)), out[-1500:]


def test_bench_lockstep_takes_turns(tmp_path, cache_dir, bench_here):
    """--lockstep: both arms run at once, one step each in turn: no two turns overlap, they alternate, and the
    training is the one each arm does alone (the same loss)."""
    import json

    import bench_vs_lightning

    bench_vs_lightning.main(["--smoke", "--lockstep", "--arms", "lightning-32,horizon", "--timeout", "120",
                             "--cache-dir", str(cache_dir), "--json", str(tmp_path / "b.json")])
    rows = {r["arm"]: r for r in json.loads((tmp_path / "b.json").read_text())["rows"]}
    turns = sorted((tuple(t), arm) for arm, r in rows.items() for t in r["turns"][0])
    assert len(turns) == 2 * (1 + 3 + 1)  # warm-up, measured, and the last (the fit's end) of each arm
    assert all(a[0][1] <= b[0][0] for a, b in zip(turns, turns[1:])), turns  # one at a time
    assert [arm for _, arm in turns] == ["lightning-32", "horizon"] * 5  # in turn, the first arm first
    assert rows["horizon"]["final_loss"] == pytest.approx(rows["lightning-32"]["final_loss"], rel=1e-3)
    with pytest.raises(ValueError, match="--lockstep with arms horizon-2x1, horizon: allowed are 2 or more arms"
                                         " of one process each"):
        bench_vs_lightning.main(["--smoke", "--lockstep", "--arms", "horizon-2x1,horizon"])


def test_bench_node_quick_runs_every_stage(tmp_path, cache_dir, bench_here):
    """bench_node's --quick: the tuner, the bench with the tuned arm reading the tuner's own cache (not the user's),
    and the profile, each a child process, at the one layout 1 x cores of tiny.yaml; node.json and the table."""
    import json

    import bench_node

    result = bench_node.main(["--quick", "--out", str(tmp_path), "--batch", "8", "--budget", "400",
                              "--cache-dir", str(cache_dir)])
    n = result["cores"]
    assert list(result["stages"]) == ["tune-small", "bench", f"profile-1x{n}"], result["stages"]
    assert all(st["rc"] == 0 for st in result["stages"].values()), {k: v["log_tail"] for k, v in
                                                                    result["stages"].items()}
    assert json.loads((tmp_path / "node.json").read_text())["stages"].keys() == result["stages"].keys()
    (entry,) = bench_node._entries(result["layouts"])  # tuned into OUT/layouts.json
    assert (entry["ranks"], entry["threads"]) == (1, n) and entry["workload"]["global_batch"] == 8
    rows = {r["arm"]: r for r in result["bench"]["rows"]}
    assert set(rows) == {f"lightning-32@1x{n}", "horizon-tuned"}
    assert (rows["horizon-tuned"]["procs"], rows["horizon-tuned"]["threads"]) == (1, n)
    assert rows["horizon-tuned"]["final_loss"] == pytest.approx(rows[f"lightning-32@1x{n}"]["final_loss"], rel=1e-3)
    prof = result["stages"][f"profile-1x{n}"]["result"]
    assert prof["devices"] == 1 and prof["threads"] == n and 0 < prof["mfu"] < 1
    table = bench_node.summary(result)
    ratio = rows["horizon-tuned"]["tokens_per_sec"] / rows[f"lightning-32@1x{n}"]["tokens_per_sec"]
    assert f"horizon-tuned / best Lightning layout (lightning-32@1x{n}): {ratio:.2f}x" in table, table
    assert f"tuned (2x64, 8 x 64): 1x{n}" in table and f"profile-1x{n}: " in table, table


def test_bench_paths_refuses_unknown_ones_and_drops_its_own_options(bench_here):
    import bench_vs_lightning as bench

    with pytest.raises(ValueError, match="--paths='amx': allowed are native, avx2"):
        bench.main(["--paths", "amx"])
    argv = ["--steps", "3", "--paths", "native,avx2", "--json=x.json", "--rounds", "1"]
    assert bench.drop_option(bench.drop_option(argv, "--paths"), "--json") == ["--steps", "3", "--rounds", "1"]


def test_bench_layout_arms():
    import bench_vs_lightning as bench

    assert bench.arm_spec("horizon@2x1")["strategy"] == {"threads_per_rank": 1}
    assert bench.arm_spec("horizon-nopin@4x4")["strategy"] == {"pin_cores": False, "threads_per_rank": 4}
    spec = bench.arm_spec("lightning-bf16@4x4")
    assert (spec["procs"], spec["strategy"], spec["env"], spec["precision"]) == (4, "ddp", {"OMP_NUM_THREADS": "4"},
                                                                                "bf16-mixed")
    assert bench.arm_spec("lightning-32@1x16")["strategy"] == "auto" and bench.ARMS["horizon"] == {"kind": "horizon",
                                                                                                  "procs": 1}
    with pytest.raises(ValueError, match="unknown 'lightning-64'"):
        bench.arm_spec("lightning-64@2x1")
    with pytest.raises(ValueError, match="RANKSxTHREADS"):
        bench.arm_spec("horizon@2")
    with pytest.raises(ValueError, match="Lightning's own strategy"):
        bench.arm_spec("horizon-nostrategy@2x1")
    # the defaults one at a time: each arm differs from "horizon" in the one part it names
    from lightning_horizon import cpu
    from lightning_horizon.precision import matmul_width, resolve_compute

    model = pretrain_gpt.GPTPretrain(n_layer=1, n_head=2, n_embd=32, block_size=16)

    def built(name):
        kw = bench._trainer_kwargs(bench.arm_spec(name), 3, timer=None, model=model)
        return (type(kw["strategy"]).__name__ if not isinstance(kw["strategy"], str) else kw["strategy"],
                [type(p).__name__ for p in kw.get("plugins", [])], kw.get("precision"),
                [type(c).__name__ for c in kw["callbacks"] if c is not None], kw.get("gradient_clip_val"))

    assert matmul_width(model) == 32
    # what HorizonPrecision("auto") computes this model in: fp32, also where bf16 is native (narrower than 96)
    same = "bf16-mixed" if resolve_compute("auto", "cpu", 32)[0] == "bf16" else "32-true"
    assert same == "32-true" or cpu.isa().name not in cpu.BF16_MIN_WIDTH
    assert built("horizon") == ("HorizonStrategy", ["HorizonPrecision"], None, ["GradNormBackoff"], None)
    assert built("horizon-noback") == ("HorizonStrategy", ["HorizonPrecision"], None, [], 1.0)
    assert built("horizon-noplugin") == ("HorizonStrategy", [], same, ["GradNormBackoff"], None)
    assert built("horizon-nostrategy") == ("auto", ["HorizonPrecision"], None, ["GradNormBackoff"], None)



def test_bench_collectives_codec_table(monkeypatch, capsys):
    """--codec: the codecs alone against copy_, one row per size, each figure a finite positive GB/s, and the ratio
    of int8's encode + error to a one-thread copy_ is the two figures' ratio."""
    import bench_collectives

    monkeypatch.setattr(sys, "argv", ["bench_collectives.py", "--codec", "--sizes", "0.25,1", "--reps", "2"])
    bench_collectives.main()
    out = capsys.readouterr().out
    table = out[out.index("== codecs alone"):].splitlines()[2:]
    # MiB, copy_ (all threads, 1 thread), int8 (encode, encode + error, decode, allreduce alone, x copy_), 3 x bf16
    rows = [line.translate(str.maketrans("/()", "   ")).split() for line in table if line.strip()]
    assert [r[0] for r in rows] == ["0.25", "1"] and all(len(r) == 11 for r in rows), out
    assert all(0 < float(v) < float("inf") for r in rows for v in r[1:]), out
    assert all(float(r[7]) == pytest.approx(float(r[4]) / float(r[2]), abs=0.01, rel=0.02) for r in rows), out


def test_bench_collectives_smoke(monkeypatch, capsys):
    """Loopback, 4 ranks as 2 x 2, one small size: every algorithm (and int8) reduces a bucket, the accounted
    inter-node bytes are the cost model's, and the predictions print. The ranks run the script's ``__main__``."""
    import bench_collectives

    monkeypatch.setattr(sys, "argv", ["bench_collectives.py", "--no-netns", "--no-shape", "--sizes", "0.25",
                                      "--reps", "2", "--with-int8", "--calls", "--timeout", "150"])
    bench_collectives.main()  # kills its ranks and raises when one fails or the timeout passes
    out = capsys.readouterr().out
    assert "== loopback" in out and "reference cluster" in out
    cells = re.findall(r"(\w+): ([\d.]+) \| ([\d.]+)", out)  # "algorithm: accounted | model" MiB per rank
    assert {name for name, _, _ in cells} == {"flat", "hierarchical", "torus2d", "hierarchical_int8"}
    assert all(accounted == model for _, accounted, model in cells), cells
    # --calls: each collective alone, min / median ms, one row per size
    row = next(line for line in out.splitlines() if line.startswith("   0.25 ")).split()[1:]
    pairs = [(float(lo), float(mid)) for lo, slash, mid in zip(row[::3], row[1::3], row[2::3]) if slash == "/"]
    assert len(pairs) == len(bench_collectives.CALLS) and all(0 < lo <= mid for lo, mid in pairs), row


def test_bench_precision_smoke(monkeypatch, capsys):
    import bench_precision

    config = "horizon bf16-true kahan"
    monkeypatch.setattr(sys, "argv", [
        "bench_precision.py", "--vocab", "64", "--dim", "32", "--layers", "1", "--heads", "2", "--seq", "16",
        "--batch", "2", "--steps", "1", "--warmup", "1", "--rounds", "1", "--threads", "1", "--configs", config,
    ])
    bench_precision.main()  # runs the config here, its peak-RSS fit in a child process
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(config + " "))
    measured, analytic = row.split()[-3:-1]
    assert float(measured) == float(analytic) == 10  # bytes per parameter: bf16 weight + compensation + grad + state

    # --compile both: every config eager and compiled, side by side, with the same bytes per parameter
    monkeypatch.setattr(sys, "argv", [*sys.argv[:-1], "horizon auto", "--compile", "both"])
    bench_precision.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("horizon auto ")]
    assert len(rows) == 2 and rows[1][2:4] == ["+", "compile"], rows
    assert float(rows[0][2]) > 0 and float(rows[1][4]) > 0 and rows[0][-3] == rows[1][-3] == "16.00", rows


def test_bench_sharding_smoke(monkeypatch, capsys):
    """One block, 16 tokens, one allocator, one step: plain, per-block checkpointing and a plan, each in its own
    process (the script's ``__main__``)."""
    import bench_sharding

    monkeypatch.setattr(sys, "argv", ["bench_sharding.py", "--allocator", "glibc", "--fractions", "", "--steps", "1",
                                      "--layers", "1", "--d", "32", "--seq", "16", "--batch", "1"])
    bench_sharding.main()
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("plain ", "per-block ", "plan@"))]
    assert rows == ["plain", "per-block", "plan@per-block"], out
