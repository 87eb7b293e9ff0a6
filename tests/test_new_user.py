"""The first minutes of a new user, as they would see them: every way of naming the strategy in a LightningCLI
script, and what a short fit prints (one subprocess, tests/scripts/new_user.py, whose output is read here).

What is checked: each naming form gives HorizonStrategy (the name only after ``import lightning_horizon``:
Lightning has no entry point for strategies; a name takes no options on the command line, the class does); a
default 20-step run prints a throughput/MFU line without anything added to the LightningModule, with its FLOPs
counted and the count said; the bar shows tok/s as an integer, samples/s for images; the monitors follow
``log_every_n_steps``; none of the package's lines lands on the progress bar's line; the precision line is
printed once per Trainer (not again at validate and test) and the allocator hint once per machine, short; the sharder's
fake-to-real fallback reads as expected.
"""

from __future__ import annotations

import re

import pytest

from lightning_horizon.precision import resolve_compute

from tests.launch import REPO, run_script

SCRIPT = REPO / "tests" / "scripts" / "new_user.py"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# the package's own lines: each must start a line, never follow a progress bar's text
OURS = re.compile(r"(ThroughputMFUMonitor: |step \d+: |fit: \d+ steps? |HorizonPrecision\(|sharding: |hint: "
                  r"|HorizonStrategy: )")


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> str:
    out = run_script(SCRIPT, [str(tmp_path_factory.mktemp("yaml"))], timeout=300).stdout
    assert "DONE" in out, out[-3000:]
    return out


def _segments(text: str) -> list[str]:
    """What a terminal would show line by line: tqdm redraws with a carriage return, so each piece between two
    carriage returns (or newlines) starts at column 0."""
    return [ANSI.sub("", seg) for line in text.split("\n") for seg in line.split("\r")]


def _section(out: str, name: str) -> str:
    start = out.index(f"FIT {name}")
    end = min((i for i in (out.find("FIT ", start + 4), out.find("DONE", start)) if i > 0))
    return out[start:end]


def test_every_way_of_naming_the_strategy(output):
    checks = dict(re.findall(r"^CHECK (.+?): (.*)$", output, re.M))
    # an unmodified script: the name is unknown (Lightning has no entry point for strategies) ...
    assert checks.pop("name, no import").startswith("error ValueError: You selected an invalid strategy name")
    # ... the class path is not, and options need the class, not the name
    assert checks.pop("name + option").startswith("error ArgumentError")
    with_option = {"class path + option", "class name + option", "yaml class_path"}
    for form, found in checks.items():
        assert found == f"HorizonStrategy threads_per_rank={1 if form in with_option else None}", (form, found)
    assert len(checks) == 9, sorted(checks)


def test_a_default_short_run_prints_throughput_and_mfu(output):
    tokens = _section(output, "tokens")
    # 20 steps under the default log_every_n_steps=50: the end-of-fit line, with FLOPs counted, not declared
    assert re.search(r"GFLOP per batch on rank 0, counted by torch's FlopCounterMode on training batch 2", tokens)
    (line,) = re.findall(r"^fit: 18 steps after 2 warm-up batches .*$", "\n".join(_segments(tokens)), re.M)
    # the script's model is 32 wide: "auto" computes it in fp32 wherever bf16 was measured to lose at that width
    compute = resolve_compute("auto", "cpu", width=32)[0]
    figures = rf": [\d,]+ tok/s \| [\d.e-]+ GFLOP/s per rank \(counted on batch 2\) \| MFU [\d.e-]+% of {compute} peak"
    assert re.search(figures, line), line
    bar = re.findall(r"tok/s=([^,\]]+)", tokens)
    assert bar and all(v.isdigit() for v in bar), sorted(set(bar))  # an integer, not 4.29e+3


def test_monitors_follow_log_every_n_steps_and_say_samples_per_second(output):
    images = "\n".join(_segments(_section(output, "images")))
    # log_every_n_steps=4, 8 steps, a window of 3 batches: full from step 5 on
    assert re.search(r"^step 8: [\d,]+ samples/s \| ", images, re.M)
    assert not re.search(r"^step 4: [\d,]+ samples/s", images, re.M)
    assert re.search(r"^step 4: memory: rank0 RSS", images, re.M) and re.search(r"^step 8: memory:", images, re.M)
    assert "tok/s" not in images and re.search(r"samples/s=\d+[,\]]", images)


def test_nothing_of_ours_lands_on_the_progress_bar_line(output):
    ours = [seg for seg in _segments(output) if OURS.search(seg)]
    assert len(ours) > 10
    on_the_bar = [seg for seg in ours if OURS.search(seg).start() > 0]
    assert on_the_bar == [], on_the_bar[:3]


def test_quiet_by_default(output):
    segments = _segments(output)
    # fit, validate and test of one Trainer: one line; the next Trainer's run says it again
    assert sum(s.startswith("HorizonPrecision(mode='bf16-mixed')") for s in _segments(_section(output, "tokens"))) == 1
    assert sum(s.startswith("HorizonPrecision(mode='bf16-mixed')") for s in segments) == 2
    hints = [s for s in segments if s.startswith("hint: ")]
    assert len(hints) <= 1 and all(len(h) <= 100 for h in hints), hints  # once per machine, short
    sharded = _section(output, "sharded")
    assert "fake pass failed" not in sharded and "Traceback" not in output
    assert "sharding: profiling a real slice of the batch (expected: " in sharded
