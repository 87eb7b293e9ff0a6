"""Atomic checkpoints: a process killed in the middle of a save leaves the previous checkpoint loadable."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_horizon import HorizonStrategy
from lightning_horizon.checkpoint_io import AtomicCheckpointIO
from tests.launch import REPO
from tests.scripts.fit import TinyLM, data


@pytest.mark.parametrize("mode", ["in_step", "background"])
def test_kill_during_large_save_leaves_previous_checkpoint_intact(tmp_path, mode):
    target = tmp_path / "last.ckpt"
    extra = ["background"] if mode == "background" else []
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/scripts/save_then_die.py"), str(target), *extra],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "SAVED_OLD"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until the new save is well under way, then kill it
            tmps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
            if tmps and tmps[0].stat().st_size > 32 * 1024 * 1024:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the large save never started")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    loaded = torch.load(target, weights_only=True)
    assert loaded["version"] == "old" and torch.equal(loaded["w"], torch.arange(10.0))
    # The next save in that directory completes and clears the debris of the killed one.
    AtomicCheckpointIO().save_checkpoint({"version": "next"}, target)
    assert torch.load(target)["version"] == "next"
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def _trainer(root, steps, **kw):
    return L.Trainer(accelerator="cpu", devices=1, strategy=HorizonStrategy(), max_steps=steps, max_epochs=-1,
                     logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                     callbacks=[ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=1)], **kw)


def test_default_checkpoint_io_is_atomic_and_resume_is_exact(tmp_path):
    loader = lambda: torch.utils.data.DataLoader(data(), batch_size=64, shuffle=True)  # 4 steps an epoch  # noqa: E731
    L.seed_everything(3, verbose=False)
    straight = TinyLM()
    trainer = _trainer(tmp_path / "a", 12)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    trainer.fit(straight, loader())

    L.seed_everything(3, verbose=False)
    first = TinyLM()
    _trainer(tmp_path / "b", 8).fit(first, loader())  # stop at an epoch boundary
    L.seed_everything(3, verbose=False)  # same seed (the sampler's order derives from it), but the RNG is
    torch.rand(1000)  # advanced differently: the strategy's checkpoint must restore the generator states
    resumed = TinyLM()
    _trainer(tmp_path / "b", 12).fit(resumed, loader(), ckpt_path="last")
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert resumed.losses == straight.losses[8:]


def test_checkpoint_file_mode_follows_the_umask_like_torch_save(tmp_path):
    """mkstemp makes 0600 files: a checkpoint must get torch.save's 0666 minus the umask, like Lightning's IO."""
    old = os.umask(0o022)
    try:
        for mask in (0o022, 0o077, 0o002):
            os.umask(mask)
            ours, theirs = tmp_path / f"ours-{mask:o}.ckpt", tmp_path / f"torch-{mask:o}.ckpt"
            AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(2)}, ours)
            torch.save({"w": torch.zeros(2)}, theirs)
            assert ours.stat().st_mode & 0o777 == theirs.stat().st_mode & 0o777 == 0o666 & ~mask
    finally:
        os.umask(old)


def test_load_memory_maps_the_file(tmp_path):
    """Every rank of a node reads one page cache: the loaded tensors are views of the mapped file, not copies (a
    legacy-format file still loads, copied)."""
    io, path = AtomicCheckpointIO(), tmp_path / "c.ckpt"
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 3}
    io.save_checkpoint(state, path)
    loaded = io.load_checkpoint(path)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert str(path) in Path("/proc/self/maps").read_text()
    legacy = tmp_path / "legacy.ckpt"
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    assert torch.equal(io.load_checkpoint(legacy)["w"], state["w"])


def test_remote_path_goes_to_lightnings_own_io(tmp_path, monkeypatch):
    """A path of another fsspec file system (``memory://`` here, ``s3://`` in practice) is written and read by
    Lightning's TorchCheckpointIO, never taken for a local folder."""
    monkeypatch.chdir(tmp_path)
    io, url = AtomicCheckpointIO(), "memory://horizon-test/c.ckpt"
    io.save_checkpoint({"w": torch.arange(4.0)}, url)
    assert torch.equal(io.load_checkpoint(url)["w"], torch.arange(4.0))
    assert list(tmp_path.iterdir()) == []  # no local "memory:" folder


def test_background_save_writes_the_state_of_the_moment_it_was_asked(tmp_path):
    io = AtomicCheckpointIO(background=True)
    w = torch.zeros(1 << 20)
    io.save_checkpoint({"w": w, "step": 1}, tmp_path / "a.ckpt")
    w += 1  # the next optimizer step, while the write may still run
    io.save_checkpoint({"w": w, "step": 2}, tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")  # behind the writes before it: never races one in flight
    io.teardown()
    assert not (tmp_path / "a.ckpt").exists()
    b = torch.load(tmp_path / "b.ckpt")
    assert b["step"] == 2 and torch.equal(b["w"], torch.ones(1 << 20))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.ckpt"]  # no temporary file left


def test_a_background_write_that_fails_fails_the_job(tmp_path, monkeypatch):
    io = AtomicCheckpointIO(background=True)
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "good.ckpt")
    io.wait()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    io.save_checkpoint({"w": torch.zeros(3)}, tmp_path / "good.ckpt")  # returns: the write runs on the thread
    with pytest.raises(RuntimeError, match="background checkpoint write failed: .*No space left"):
        io.save_checkpoint({"w": torch.zeros(3)}, tmp_path / "next.ckpt")  # the next save raises it
    monkeypatch.undo()
    assert torch.equal(torch.load(tmp_path / "good.ckpt")["w"], torch.ones(3))  # the previous one is intact
    monkeypatch.setattr(torch, "save", disk_full)
    io.save_checkpoint({"w": torch.zeros(3)}, tmp_path / "good.ckpt")
    with pytest.raises(RuntimeError, match="No space left"):
        io.teardown()  # the fit's end raises it too


def _background(root, steps):
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=2, monitor="step",
                           mode="max")
    return L.Trainer(accelerator="cpu", devices=1, strategy=HorizonStrategy(checkpoint_io=AtomicCheckpointIO(
        background=True)), max_steps=steps, max_epochs=-1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, callbacks=[ckpt])


def test_background_checkpoints_in_a_fit_keep_top_k_and_resume_exactly(tmp_path):
    """ModelCheckpoint saves every step and removes older files while writes are in flight; the resume is exact."""
    loader = lambda: torch.utils.data.DataLoader(data(), batch_size=64, shuffle=True)  # noqa: E731
    L.seed_everything(3, verbose=False)
    straight = TinyLM()
    _trainer(tmp_path / "a", 12).fit(straight, loader())
    L.seed_everything(3, verbose=False)
    first = TinyLM()
    _background(tmp_path / "b", 6).fit(first, loader())  # stops mid-epoch
    names = sorted(p.name for p in (tmp_path / "b" / "ckpt").iterdir())
    assert len(names) == 3 and "last.ckpt" in names, names  # top 2 by step, and last: nothing leaked or lost
    L.seed_everything(3, verbose=False)
    resumed = TinyLM()
    _background(tmp_path / "b", 12).fit(resumed, loader(), ckpt_path="last")
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_bench_checkpoint_smoke(tmp_path):
    sys.path.insert(0, str(REPO / "recipes"))
    import bench_checkpoint

    result = bench_checkpoint.main(["--smoke", "--json", str(tmp_path / "r.json")])
    assert [f["arm"] for f in result["fits"]] == ["background", "sync"]
    for fit in result["fits"]:
        assert fit["pairs"] >= 2 and fit["cost"] is not None and fit["tokens_per_s_without"] > 0
        assert fit["checkpoint_mb"] > 0
