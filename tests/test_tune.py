"""The layout tuner and its rule: candidates, selection, memory refusal and failures with fake workers, the cache,
the rule, the recipe's automatic layout, and one real tuning run of the tiny recipe on 2 cores (1 x 2 against 2 x 1).

The fake workers are a few lines of Python without torch, so the runner's logic (order, batch split, refusal,
retries, failures) is tested in real processes in well under a second each.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest

from lightning_horizon.layout import cache as layout_cache
from lightning_horizon.layout import Layout, Machine, candidates, model_sizes, rule_layout, workload
from lightning_horizon.layout.tuner import Result, predict_memory, select, table, tune
from lightning_horizon.tune import main
from tests.launch import REPO, run_script

GiB = 2**30
XEON16 = Machine("Intel Xeon (family 6, model 143)", cores=16, l2_per_core=2 << 20)  # the node
ZEN3_2 = Machine("AMD EPYC (family 25, model 1)", cores=2, l2_per_core=512 << 10)  # this machine
# (parameter bytes, largest parameter bytes) of the recipe's configs, fp32
TINY_SIZES, SMALL_SIZES = (4 * 119_104, 4 * 64 * 256), (4 * 10_818_432, 4 * 384 * 1536)  # no biases


def L(text: str) -> Layout:
    return Layout.parse(text)


# ------------------------------------------------------------------------------------------------ candidates


@pytest.mark.parametrize("cores, domains, expected", [
    (2, 1, "1x2 2x1"),
    (16, 1, "1x16 2x8 4x4 8x2 16x1"),
    (12, 1, "1x12 2x6 4x3 12x1"),  # not a power of two: equal slices only
    (7, 1, "1x7 7x1"),
    (16, 2, "1x16 2x8 4x4 8x2 16x1"),  # per domain of 8: 1, 2, 4, 8 ranks, times 2 domains; plus one process
    (12, 2, "1x12 2x6 4x3 12x1"),
    (96, 2, "1x96 2x48 4x24 8x12 16x6 32x3 96x1"),
])
def test_candidates(cores, domains, expected):
    assert candidates(cores, domains) == [L(t) for t in expected.split()]


def test_candidates_keep_ranks_inside_numa_domains():
    for lay in candidates(16, 2):
        assert lay.ranks == 1 or lay.ranks % 2 == 0  # only the single process spans both domains
        assert lay.ranks * lay.threads == 16


@pytest.mark.parametrize("call, match", [
    (lambda: candidates(0), r"candidates\(cores=0\): allowed is an int >= 1"),
    (lambda: candidates(12, 5), r"candidates\(domains=5\): allowed is a divisor of cores=12"),
    (lambda: Layout(0, 2), r"Layout\(ranks=0\)"),
    (lambda: Layout.parse("4by4"), r"Layout.parse\(text='4by4'\): allowed is 'RANKSxTHREADS'"),
    (lambda: Machine("x", cores=6, domains=4), r"Machine\(domains=4\)"),
    (lambda: select([], tolerance=1.5), r"select\(tolerance=1.5\)"),
])
def test_bad_input_names_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_layout_parses_and_prints():
    assert L("4x4") == Layout(4, 4) == L(" 4 x 4 ") and str(Layout(2, 8)) == "2 x 8"


# ------------------------------------------------------------------------------------------------ selection


def _ok(text: str, tps: float, rss: float = 1.0) -> Result:
    lay = L(text)
    return Result(lay, "ok", tps, "tokens/s", 1 / tps, [int(rss * GiB)] * lay.ranks)


def test_select_takes_the_fastest():
    results = [_ok("1x16", 100), _ok("4x4", 150), _ok("16x1", 120)]
    assert select(results).layout == L("4x4")


def test_select_tie_goes_to_fewer_ranks():
    results = [_ok("2x8", 100), _ok("4x4", 102), _ok("16x1", 101)]
    assert select(results, tolerance=0.03).layout == L("2x8")  # within 3% of 102: fewer ranks, less memory
    assert select(results, tolerance=0.0).layout == L("4x4")
    assert select(results[1:], tolerance=0.03).layout == L("4x4")


def test_select_ignores_failed_refused_skipped():
    results = [Result(L("1x4"), "failed", note="exit 1"), _ok("2x2", 50),
               Result(L("4x1"), "refused", 999.0), Result(L("3x1"), "skipped")]
    assert select(results).layout == L("2x2")
    assert select(results[:1]) is None
    text = table(results, select(results))
    assert "2 x 2 (winner)" in text and "failed: exit 1" in text and "refused" in text


def test_predict_memory_scales_the_most_ranked_measured_layout():
    done = [_ok("1x4", 1, rss=2.0), _ok("2x2", 1, rss=1.5), Result(L("8x1"), "failed")]
    assert predict_memory(L("1x4"), done) is None
    assert predict_memory(L("4x1"), done) == 4 * int(1.5 * GiB)


# ------------------------------------------------------------------------------------ the runner, fake workers

FAKE = textwrap.dedent("""
    import json, os, sys
    ranks, threads, step, rss, batch, fail, foreign = sys.argv[1:8]
    if fail == "1":
        sys.exit("out of memory (fake)")
    ends = [i * float(step) for i in range(8)]
    json.dump({"ends": ends, "ranks": int(ranks), "threads": int(threads), "peak_rss": [int(float(rss))] * int(ranks),
               "foreign": float(foreign), "param_bytes": 1000, "largest_bytes": 100,
               "workload": {"module": "Fake", "hparams": {}, "global_batch": int(batch) * int(ranks), "seq_len": 4}},
              open(os.environ["HORIZON_TUNE_OUT"], "w"))
""")


def _fake(step_s: dict, rss: dict, fail=(), per_rank_default=6, foreign=None):
    calls = []

    def command(lay, per_rank_batch, run_dir):
        calls.append((str(lay), per_rank_batch))
        load = foreign.pop(0) if foreign else 0.0
        return [sys.executable, "-c", FAKE, str(lay.ranks), str(lay.threads), str(step_s[str(lay)]),
                str(rss.get(str(lay), GiB)), str(per_rank_batch or per_rank_default), str(int(str(lay) in fail)),
                str(load)]

    return command, calls


def test_runner_refuses_skips_and_survives_failures():
    steps = {"1 x 4": 0.4, "2 x 2": 0.25, "3 x 1": 0.1, "4 x 1": 0.1, "8 x 1": 0.05}
    command, calls = _fake(steps, {"1 x 4": 1.0 * GiB, "2 x 2": 0.9 * GiB}, fail={"8 x 1"}, per_rank_default=8)
    lines = []
    results = tune(command, [L("4x1"), L("2x2"), L("1x4"), L("3x1")], warmup=2, steps=5, retries=0,
                   free_memory=lambda: 3 * GiB, progress=lines.append)
    by = {str(r.layout): r for r in results}
    assert [str(r.layout) for r in results] == ["1 x 4", "2 x 2", "3 x 1", "4 x 1"]  # fewest ranks first
    assert by["1 x 4"].status == by["2 x 2"].status == "ok"
    assert by["1 x 4"].throughput == pytest.approx(8 * 4 / 0.4)  # global batch 8 x 4 tokens per 0.4 s step
    assert by["3 x 1"].status == "skipped" and "batch 8" in by["3 x 1"].note
    assert by["4 x 1"].status == "refused" and "3.60 GiB > 3.00 GiB" in by["4 x 1"].note  # 4 x 0.9 GiB
    assert calls == [("1 x 4", None), ("2 x 2", 4)]  # the global batch (8) learned from 1 rank, split over 2
    assert select(results).layout == L("2x2")
    assert len(lines) == 4 and lines[0].startswith("[1/4] 1 x 4:")

    command, _ = _fake(steps, {}, fail={"8 x 1"})
    results = tune(command, [L("8x1"), L("1x4")], global_batch=8, retries=0, free_memory=lambda: 64 * GiB,
                   progress=lambda s: None)
    assert [r.status for r in results] == ["ok", "failed"]
    assert "out of memory (fake)" in results[1].note


def test_runner_reruns_a_layout_measured_on_a_busy_machine():
    command, calls = _fake({"1 x 2": 0.1}, {}, foreign=[0.6, 0.05])
    results = tune(command, [L("1x2")], retries=2, max_foreign=0.1, progress=lambda s: None)
    assert len(calls) == 2 and results[0].foreign == pytest.approx(0.05)  # the quiet rerun counts


# ------------------------------------------------------------------------------------------------ the command line

# a script that leaves a mark when a layout runs it: the flag checks below must fail before any does
MARKS = "import pathlib, sys; pathlib.Path(__file__).with_suffix('.ran').write_text(' '.join(sys.argv))\n"


@pytest.mark.parametrize("flag, value, allowed", [
    ("--tolerance", "2.0", "a number in [0, 1)"),
    ("--tolerance", "nan", "a number in [0, 1)"),
    ("--steps", "1", "an int >= 2"),
    ("--steps", "2.5", "an int >= 2"),
    ("--warmup", "0", "an int >= 1"),
    ("--timeout", "0", "a finite number of seconds > 0"),
    ("--timeout", "inf", "a finite number of seconds > 0"),
    ("--max-foreign", "1.5", "a share in [0, 1]"),
    ("--retries", "-1", "an int >= 0"),
    ("--batch", "0", "an int >= 1"),
    ("--layouts", "4by4", "'all' or comma-separated RANKSxTHREADS"),
    ("--layouts", ",", "'all' or comma-separated RANKSxTHREADS"),
])
def test_every_flag_is_checked_before_any_layout_runs(tmp_path, capsys, flag, value, allowed):
    script = tmp_path / "train.py"
    script.write_text(MARKS)
    with pytest.raises(SystemExit) as info:
        main(["--layouts", "1x1", "--no-cache", flag, value, str(script)])
    out, err = capsys.readouterr()
    assert info.value.code == 2  # argparse's usage error
    assert f"error: argument {flag}: invalid value {value!r}" in err and allowed in err, err
    assert "Traceback" not in err and out == ""
    assert not script.with_suffix(".ran").exists()  # no layout ran


def test_a_missing_script_fails_before_any_layout_runs(tmp_path, capsys):
    missing = tmp_path / "no_such_script.py"
    with pytest.raises(SystemExit) as info:
        main(["--layouts", "1x1", "--no-cache", str(missing), "--config", "x.yaml"])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and f"error: argument script: {str(missing)!r} does not exist" in err, err
    assert out == ""


def _config_script(path, config: str, then: str = "raise RuntimeError('bad config: no corpus')"):
    """A script that answers ``--print_config`` as LightningCLI does (with ``config``) and otherwise runs ``then``;
    it leaves a mark when it is run for a layout."""
    path.write_text(textwrap.dedent(f"""
        import pathlib, sys
        if "--print_config" in sys.argv:
            print("# lightning.pytorch==2.6.6\\n" + {config!r})
            sys.exit(0)
        pathlib.Path(__file__).with_suffix(".ran").write_text(" ".join(sys.argv))
        print("loading the data", flush=True)
        {then}
    """))
    return path


HORIZON_CFG = "trainer:\n  strategy:\n    class_path: lightning_horizon.HorizonStrategy\ndata:\n  batch_size: 8\n"


@pytest.mark.parametrize("script, config, layouts, says", [
    ("crashes.py", None, "1x1", ["`crashes.py fit --print_config` failed (exit 1)", "RuntimeError: bad config",
                                 "needs a LightningCLI script"]),
    ("ddp.py", "trainer:\n  strategy: ddp\ndata:\n  batch_size: 8\n", "1x1",
     ["trains with strategy='ddp'", "add --trainer.strategy=lightning_horizon.HorizonStrategy"]),
    ("plain.py", "model:\n  lr: 0.1\n", "1x1", ["has no trainer section", "needs a LightningCLI script"]),
    ("nobatch.py", "trainer:\n  strategy: horizon\n", "1x1,2x1", ["has no data.batch_size", "--batch-arg"]),
    ("test.py", HORIZON_CFG, "1x1", ["the tuner runs the script's fit: drop 'test'"]),
])
def test_a_script_the_tuner_cannot_run_fails_before_any_layout_runs(tmp_path, capsys, script, config, layouts,
                                                                     says):
    path = tmp_path / script
    if config is None:
        path.write_text("raise RuntimeError('bad config: no corpus')\n")
    else:
        _config_script(path, config)
    with pytest.raises(SystemExit) as info:
        main(["--layouts", layouts, "--no-cache", str(path), *(["test"] if script == "test.py" else [])])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "" and "Traceback (most recent call last)" not in err.split("failed")[0]
    for text in says:
        assert text in err, err
    assert not path.with_suffix(".ran").exists()  # no layout ran


def test_when_no_layout_ran_the_exit_code_and_message_say_why(tmp_path, capsys):
    script = _config_script(tmp_path / "crashes.py", HORIZON_CFG)
    cache = tmp_path / "layouts.json"
    with pytest.raises(SystemExit) as info:
        main(["--layouts", "1x1,2x1", "--cache", str(cache), str(script)])
    out, err = capsys.readouterr()
    assert info.value.code == 1
    assert "tune: no layout ran; nothing cached" in err
    for layout in ("1 x 1", "2 x 1"):  # each failure with its exit code and the tail of its output
        assert f"{layout} failed: exit 1 after " in err and "RuntimeError: bad config: no corpus" in err, err
    assert not cache.exists()


RUN_FALSE = textwrap.dedent("""
    # Lightning's CLI example shape: LightningCLI(run=False), the script calls fit itself; the strategy by name
    import torch
    import lightning as L
    from lightning.pytorch.cli import LightningCLI
    from torch.utils.data import DataLoader, TensorDataset
    import lightning_horizon  # noqa: F401  (registers "horizon")

    class Tokens(L.LightningModule):
        def __init__(self, width: int = 16):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(32, width), torch.nn.Linear(width, 32)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Data(L.LightningDataModule):
        def __init__(self, batch_size: int = 4):
            super().__init__()
            self.batch_size = batch_size

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randint(0, 32, (64, 8)), torch.randint(0, 32, (64, 8))),
                              batch_size=self.batch_size)

    cli = LightningCLI(Tokens, Data, run=False, trainer_defaults={"accelerator": "cpu", "strategy": "horizon",
                                                                  "logger": False, "enable_checkpointing": False})
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
""")


def test_a_run_false_script_with_the_strategy_by_name_is_tuned(tmp_path, capsys):
    # the shape check finds no subcommands (no `fit` prepended) and hands the name on as its class path, so that
    # the layout's threads_per_rank can be set: the layout runs and is measured
    script = tmp_path / "cli_example.py"
    script.write_text(RUN_FALSE)
    winner = main(["--layouts", "1x1", "--warmup", "1", "--steps", "2", "--retries", "0", "--no-cache", str(script)])
    out = capsys.readouterr().out
    assert winner.layout == L("1x1") and winner.status == "ok" and "tokens/s" in out, out


# ------------------------------------------------------------------------------------------------ cache


WL = {"module": "GPTPretrain", "hparams": {"n_layer": 2, "betas": (0.9, 0.95)}, "global_batch": 8, "seq_len": 64}


def test_cache_round_trip_and_keys(tmp_path):
    path = tmp_path / "sub" / "layouts.json"
    assert layout_cache.lookup(WL, path, ZEN3_2) is None  # no file yet
    k = layout_cache.store(WL, {"ranks": 2, "threads": 1, "throughput": 5000.0, "unit": "tokens/s"}, path, ZEN3_2)
    entry = layout_cache.lookup(WL, path, ZEN3_2)
    assert entry["ranks"] == 2 and entry["workload"]["hparams"]["betas"] == [0.9, 0.95]
    assert layout_cache.lookup({**WL, "hparams": {"n_layer": 2, "betas": [0.9, 0.95]}}, path, ZEN3_2) is not None
    assert layout_cache.lookup({**WL, "global_batch": 16}, path, ZEN3_2) is None  # another batch
    assert layout_cache.lookup(WL, path, XEON16) is None  # another machine
    assert layout_cache.key(WL, ZEN3_2) == k != layout_cache.key(WL, XEON16)
    layout_cache.store({**WL, "global_batch": 16}, {"ranks": 1, "threads": 2}, path, ZEN3_2)
    assert len(layout_cache.load(path)) == 2 and [p.name for p in path.parent.iterdir()] == ["layouts.json"]
    with pytest.raises(ValueError, match="Layout"):
        layout_cache.store(WL, {"ranks": 0, "threads": 1}, path, ZEN3_2)


def test_cache_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(layout_cache.CACHE_ENV, str(tmp_path / "x.json"))
    assert layout_cache.cache_path() == tmp_path / "x.json"
    assert layout_cache.cache_path(tmp_path / "y.json") == tmp_path / "y.json"
    monkeypatch.delenv(layout_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert layout_cache.cache_path() == tmp_path / "lightning_horizon" / "layouts.json"


@pytest.mark.parametrize("text", ["{not json", "[]", '{"entries": 3}'])
def test_corrupt_cache_is_ignored_with_a_warning_and_replaced(tmp_path, text):
    path = tmp_path / "layouts.json"
    path.write_text(text)
    with pytest.warns(UserWarning, match="layout cache .* ignored"):
        assert layout_cache.lookup(WL, path, ZEN3_2) is None
    with pytest.warns(UserWarning):
        layout_cache.store(WL, {"ranks": 2, "threads": 1}, path, ZEN3_2)
    assert layout_cache.lookup(WL, path, ZEN3_2)["ranks"] == 2
    assert json.loads(path.read_text())["version"] == 1


def test_choose_prefers_the_tuned_layout_and_hands_it_to_started_ranks(tmp_path, monkeypatch):
    path = tmp_path / "layouts.json"
    monkeypatch.delenv(layout_cache.CHOSEN_ENV, raising=False)
    lay, why = layout_cache.choose(WL, *TINY_SIZES, path=path, machine=ZEN3_2)
    assert (lay, why.split(":")[0]) == (L("2x1"), "rule")
    layout_cache.store(WL, {"ranks": 1, "threads": 2, "throughput": 1234.0, "unit": "tokens/s"}, path, ZEN3_2)
    monkeypatch.delenv(layout_cache.CHOSEN_ENV)
    lay, why = layout_cache.choose(WL, *TINY_SIZES, path=path, machine=ZEN3_2)
    assert lay == L("1x2") and why.startswith("tuned ") and "1,234 tokens/s" in why
    # a rank Lightning's launcher started takes what the launching process chose, whatever the cache says now
    path.unlink()
    lay, why = layout_cache.choose(WL, *TINY_SIZES, path=path, machine=ZEN3_2)
    assert lay == L("1x2") and why.startswith("chosen by the launching process: tuned")
    lay, _ = layout_cache.choose({**WL, "global_batch": 4}, *TINY_SIZES, path=path, machine=ZEN3_2)
    assert lay == L("2x1")  # another workload does not inherit it


# ------------------------------------------------------------------------------------------------ the rule


def test_rule_matches_the_measured_machines():
    # 16-core Xeon, small GPT: 4 x 4 was the fastest layout in both of the runs
    assert rule_layout(*SMALL_SIZES, XEON16, 16)[0] == L("4x4")
    # this 2-core Zen 3 (docs/layout.md): the small GPT wants both cores per rank, the tiny one a rank per core
    assert rule_layout(*SMALL_SIZES, ZEN3_2, 16)[0] == L("1x2")
    assert rule_layout(*TINY_SIZES, ZEN3_2, 8)[0] == L("2x1")


def test_rule_respects_batch_memory_and_domains():
    lay, why = rule_layout(*TINY_SIZES, XEON16, global_batch=12)  # 16 and 8 ranks do not split 12
    assert lay == L("4x4") and "16 ranks do not split batch 12" in why
    big = 2 * GiB  # 0.5 B parameters: 5 x 2 GiB + 0.4 GiB per rank
    lay, why = rule_layout(big, 4 << 20, XEON16, 16, free_memory=30 * GiB)
    assert lay == L("2x8") and "exceed" in why
    assert rule_layout(big, 4 << 20, XEON16, 16, free_memory=5 * GiB)[0] == L("1x16")
    two_sockets = Machine("Xeon", cores=32, domains=2, l2_per_core=2 << 20)
    assert rule_layout(*SMALL_SIZES, two_sockets, 16)[0] == L("8x4")  # 4 x 4 per domain
    assert rule_layout(100 * GiB, 64 * GiB, two_sockets, 16)[0] == L("2x16")  # capped at a domain
    with pytest.raises(ValueError, match=r"rule_layout\(global_batch=0\)"):
        rule_layout(*TINY_SIZES, ZEN3_2, global_batch=0)


def test_workload_and_sizes_of_a_module():
    import torch

    sys.path.insert(0, str(REPO / "recipes"))
    from pretrain_gpt import GPTPretrain

    with torch.device("meta"):
        module = GPTPretrain(n_layer=2, n_head=2, n_embd=64, block_size=64, lr=1e-3)
    wl = workload(module, 8, 64)
    assert wl["module"] == "GPTPretrain" and wl["global_batch"] == 8 and wl["seq_len"] == 64
    assert wl["hparams"]["n_embd"] == 64 and "lr" not in wl["hparams"] and "betas" not in wl["hparams"]
    assert model_sizes(module) == TINY_SIZES  # tied embedding counted once; the largest is the 64 x 256 MLP


# ------------------------------------------------------------------------------------------------ one real run


TINY = str(REPO / "recipes" / "configs" / "tiny.yaml")


@pytest.mark.slow  # ~30 s of real runs; the runner, selection, cache and hand-over are tested above without them
def test_real_tuning_on_two_cores_feeds_the_recipe(tmp_path, monkeypatch):
    """1 x 2 against 2 x 1 on the tiny recipe (1 warm-up + 3 measured steps each), cached; the recipe then takes it."""
    if Machine.here().cores < 2:
        pytest.skip("needs 2 cores")
    cache, corpus = tmp_path / "layouts.json", tmp_path / "corpus"
    t0 = time.perf_counter()
    # run_script starts `python SCRIPT ARGS`: "-m" makes it the tuner's module in its own process group
    out = run_script("-m", ["lightning_horizon.tune", "--layouts", "1x2,2x1", "--warmup", "1", "--steps", "3",
                            "--retries", "0", "--cache", str(cache), str(REPO / "recipes" / "pretrain_gpt.py"),
                            "--config", TINY, "--data.cache_dir", str(corpus)], timeout=150).stdout
    elapsed = time.perf_counter() - t0
    assert "[1/2] 1 x 2: " in out and "[2/2] 2 x 1: " in out and "winner: " in out and "rule without tuning" in out
    (entry,) = layout_cache.load(cache).values()
    rows = {row["layout"]: row for row in entry["table"]}
    assert set(rows) == {"1 x 2", "2 x 1"} and all(r["status"] == "ok" for r in rows.values()), rows
    for name, row in rows.items():
        ranks = int(name[0])
        assert row["throughput"] > 0 and len(row["peak_rss"]) == ranks
        assert all(100 * 2**20 < b < 4 * GiB for b in row["peak_rss"])  # a real interpreter with torch, per rank
        assert "ran as" not in row["note"]  # the worker ran the layout it was given
    best = max(rows.values(), key=lambda r: r["throughput"])
    winner = f"{entry['ranks']} x {entry['threads']}"
    assert rows[winner]["throughput"] >= 0.97 * best["throughput"]  # the fastest, or within the tolerance
    assert entry["workload"]["global_batch"] == 8 and entry["workload"]["seq_len"] == 64
    assert elapsed < 120, f"tuning took {elapsed:.0f} s"

    # the recipe takes the tuned layout when the user gives none, splitting the global batch over the ranks
    sys.path.insert(0, str(REPO / "recipes"))
    import pretrain_gpt

    monkeypatch.setenv(layout_cache.CACHE_ENV, str(cache))
    monkeypatch.delenv(layout_cache.CHOSEN_ENV, raising=False)
    cli = pretrain_gpt.main(["--config", TINY, "--data.cache_dir", str(corpus)], run=False)
    assert cli.trainer.num_devices == entry["ranks"]
    assert cli.config.trainer.strategy.init_args.threads_per_rank == entry["threads"]
    assert cli.datamodule.batch_size == 8 // entry["ranks"]
    assert "|tuned " in os.environ[layout_cache.CHOSEN_ENV]
    # given devices: the user's layout, the batch per rank as written
    monkeypatch.delenv(layout_cache.CHOSEN_ENV)
    cli = pretrain_gpt.main(["--config", TINY, "--data.cache_dir", str(corpus), "--trainer.devices", "1"], run=False)
    assert cli.trainer.num_devices == 1 and cli.datamodule.batch_size == 8
    assert cli.config.trainer.strategy.init_args.threads_per_rank is None
