"""Out-of-core training (``HorizonStrategy(state_store=...)``, lightning_horizon/store/).

A store only changes where the bytes live between uses: every fit with a store must give exactly (bitwise) the
weights and losses of the same fit in RAM, step by step. The fits run through tests/scripts/composition_fit.py, in
pairs (store, RAM) over every valid pair of precision, optimization, backoff, scheduler, recompute, model and
prefetch mode (tests/pairwise.py), at 1 rank and at 2 gloo ranks; each store fit also reports that its parameters and
optimizer state really were the store's memory-mapped tensors. Checkpoints resume exactly, also after a SIGKILL
(which leaves nothing in the store's folder); a full disk or an unwritable folder fails at setup, and the disk
reserved there is, to the byte, what the first step creates (the optimizer state it really keeps); the disk probe
fits itself to the space left; fits sharing a folder, one after another or at once, each work in a subfolder of
their own and leave the folder; gradient accumulation with parameters that get no gradient in some micro-batches is
bitwise the RAM fit; a skipped step leaves the store's bytes untouched; peak memory stays a layer's worth above the
process, where the RAM fit holds the whole state. A model declared on the meta device (the recipe GPT, a Hugging
Face Llama) is built into the store with the in-RAM init and generator bit for bit and trains to the RAM fit's
weights; it checkpoints and resumes without being built, loads for inference and converts to safetensors; a model
built whole that cannot fit fails at setup in one line (under a memory cgroup where one can be made).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from lightning_horizon import GradNormBackoff, HorizonStrategy
from lightning_horizon.optim import step_in_parts
from lightning_horizon.state import TrainingState
from lightning_horizon.store import StateStore, StoreConfig, StoreSpaceError, resolve_store
from lightning_horizon.store.step import StreamedStep
from lightning_horizon.store.units import plan_units
from tests.launch import REPO, run_script
from tests.scripts.out_of_core_fits import Partial, StepsInBackward, accumulated_fit
from tests.pairwise import all_pairs

FITS = REPO / "tests" / "scripts" / "out_of_core_fits.py"  # every multi-process job (composition_fit.py's runs too)
MEMORY = REPO / "tests" / "scripts" / "out_of_core_memory.py"
STEPS, SAVE_AT = 4, 2


# ---------------------------------------------------------------------------------------------- no processes


def test_units_are_the_blocks_and_shared_parameters_stay_resident():
    sys.path.insert(0, str(REPO))
    from recipes.gpt import GPT, GPTConfig
    from lightning.pytorch.demos import Transformer
    from lightning.pytorch.demos.boring_classes import BoringModel

    gpt = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=16))
    units = plan_units(gpt)
    assert [u.name for u in units] == ["blocks.0", "blocks.1", "blocks.2", ""]
    resident = {id(p) for p in units[-1].params}
    assert id(gpt.wte.weight) in resident and id(gpt.head.weight) in resident  # tied: used outside the blocks
    assert sorted(id(p) for u in units for p in u.params) == sorted(id(p) for p in gpt.parameters())  # once each
    demo = plan_units(Transformer(vocab_size=50, nlayers=2))  # Lightning's demo: its largest stack of layers
    assert [u.name for u in demo[:-1]] == ["transformer.decoder.layers.0", "transformer.decoder.layers.1"]
    assert [u.streamed for u in plan_units(BoringModel())] == [False]  # no stack: resident, state still stored


@pytest.mark.parametrize("kwargs, names", [
    ({"state_store": 3}, ("state_store=3", "'auto'", "StoreConfig")),
    ({"state_store": ""}, ("state_store=''",)),
    ({"state_store": "/x\0y"}, ("state_store='/x\\x00y'", "a folder path")),
    ({"state_store": "auto", "state": "node_sharded"}, ("state_store='auto'", "state='node_sharded'", "replicated")),
])
def test_refused_by_name(kwargs, names):
    with pytest.raises(ValueError) as err:
        HorizonStrategy(**kwargs)
    assert all(n in str(err.value) for n in names), str(err.value)


@pytest.mark.parametrize("kwargs, names", [
    ({"prefetch": "mmap"}, ("StoreConfig(prefetch='mmap')", "'read'", "'readahead'", "'none'")),
    ({"probe_bytes": -1}, ("StoreConfig(probe_bytes=-1)", ">= 0")),
    ({"readers": 0}, ("StoreConfig(readers=0)", ">= 1")),
    ({"step": "early"}, ("StoreConfig(step='early')", "'auto'", "'in_backward'", "'after_backward'")),
    ({"path": 5}, ("StoreConfig(path=5)", "folder")),
    ({"path": ""}, ("StoreConfig(path='')", "None", "a folder path (non-empty")),
    ({"path": Path("/x\0y")}, ("StoreConfig(path=", "no NUL byte")),
    ({"readers": 65}, ("StoreConfig(readers=65)", "<= 64")),
    ({"readers": True}, ("StoreConfig(readers=True)", ">= 1")),
    ({"probe_bytes": 4096}, ("StoreConfig(probe_bytes=4096)", "0 (no disk probe)", "1048576")),
    ({"probe_bytes": False}, ("StoreConfig(probe_bytes=False)", "int >= 0")),
    ({"pretrained": 5}, ("StoreConfig(pretrained=5)", "safetensors file's path")),
    ({"pretrained": ()}, ("StoreConfig(pretrained=())", "a tuple of paths")),
    ({"pretrained_prefix": 1}, ("StoreConfig(pretrained_prefix=1)", "a str")),
])
def test_config_refused_by_name(kwargs, names):
    with pytest.raises(ValueError) as err:
        StoreConfig(**kwargs)
    assert all(n in str(err.value) for n in names), str(err.value)


def test_resolve():
    assert resolve_store(None) is None
    assert resolve_store("auto") == StoreConfig()
    assert resolve_store("/x") == StoreConfig(path="/x")
    assert resolve_store(Path("/x")) == StoreConfig(path="/x")


def test_split_shares_every_byte_once_in_whole_pages():
    from lightning_horizon.store.files import PAGE
    from lightning_horizon.store.sizes import split

    class File:
        def __init__(self, used: int) -> None:
            self.used = used

    files = [File(10_000), File(3 * PAGE + 5), File(1), File(40 * PAGE)]
    for n in (1, 2, 3, 7, 100):
        parts = split(files, n)
        assert 1 <= len(parts) <= n
        for f in files:  # each file covered once, in order, by ranges that start on a page
            ranges = [(a, b) for part in parts for g, a, b in part if g is f]
            assert ranges[0][0] == 0 and ranges[-1][1] == f.used
            assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:])) and all(a % PAGE == 0 for a, _ in ranges)
        sizes = [sum(b - a for _, a, b in part) for part in parts]
        assert max(sizes) - min(sizes) <= 45 * PAGE // n + PAGE or n >= 45  # about equal shares
    assert split([], 2) == []


def test_overwriting_discarded_bytes_reads_nothing_back(tmp_path):
    """Tensors placed over dropped ones (new gradients over last step's) read nothing back from the disk once the
    file's bytes are discarded; a discarded range keeps the partial pages at its ends."""
    from lightning_horizon.store.files import PAGE, MappedFile
    from lightning_horizon.store.files import io_counters

    f = MappedFile(str(tmp_path), "g", 64 * PAGE)
    views = [f.view(torch.Size([n]), torch.float32) for n in (10, 5 * PAGE + 3, 10)]

    def overwrite(discard: Any) -> int:
        f.raw.fill_(7)
        f.unmap()
        f.writeback(True)  # on the disk only
        r0, _ = io_counters()
        if discard:
            discard()
        for v in views:
            v.copy_(torch.arange(v.numel(), dtype=torch.float32))
        return io_counters()[0] - r0

    if overwrite(None) == 0:
        pytest.skip("this file system reports no disk reads (/proc/thread-self/io)")
    if overwrite(lambda: f.discard(0, f.used)) != 0 and not f._zero_range:
        pytest.skip("this file system has no FALLOC_FL_ZERO_RANGE")
    assert overwrite(lambda: f.discard(0, f.used)) == 0
    assert all(torch.equal(v, torch.arange(v.numel(), dtype=torch.float32)) for v in views)
    start = views[1].data_ptr() - f.raw.data_ptr()
    f.raw.fill_(7)
    f.discard(start, start + views[1].numel() * 4)
    assert bool((views[0].view(torch.uint8) == 7).all()) and bool((views[2].view(torch.uint8) == 7).all())
    assert int(views[1].view(torch.uint8)[PAGE:2 * PAGE].sum()) == 0  # an inner page: zeros
    f.close()


def test_new_gradients_read_nothing_of_the_last_ones(tmp_path):
    """After ``zero_grad`` a backward writes its gradients over last step's without reading them back from the disk;
    gradients that accumulate (no ``zero_grad``) are read back and summed: the same values as in RAM."""
    from lightning_horizon.store.files import io_counters

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(3)], nn.Linear(256, 1))

    model, twin, x = make(), make(), torch.randn(4, 256)
    store = StateStore(str(tmp_path), plan_units(model), "none", 1, training_state=TrainingState())
    store.install()
    try:
        for u in store.units:  # weights stay mapped once read: the reads below are the gradients' only
            store.pin(u)

        def backward(zero: bool) -> int:
            for m in (model, twin):
                if zero:
                    m.zero_grad(set_to_none=True)
                m(x).sum().backward()
            store.drain()
            store.new_step()
            return io_counters("/proc/self/io")[0]

        backward(True)
        backward(True)  # every file exists and is on the disk
        r0 = io_counters("/proc/self/io")[0]
        fresh = backward(True) - r0
        accumulated = backward(False) - fresh - r0
        if accumulated == 0:
            pytest.skip("this file system reports no disk reads (/proc/self/io)")
        assert fresh == 0  # last step's gradients were dead: discarded, not read
        assert accumulated >= 3 * 256 * 256 * 4  # live ones: read back and summed
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad)
    finally:
        store.uninstall()


def test_disk_probe_measures_reads_alone_and_while_writing(tmp_path):
    from lightning_horizon.store.probe import disk_bandwidth

    bw = disk_bandwidth(str(tmp_path), 4 << 20)
    assert bw.read > 0 and bw.write > 0 and bw.shared_read > 0
    assert os.listdir(tmp_path) == []  # unlinked at once


@pytest.mark.parametrize("readers", [1, 3])
def test_reads_are_measured_alone_or_shared_with_a_write_back(tmp_path, readers):
    """The reading threads' bytes and wall time count as "alone" when no write-back ran during them and as "shared"
    when one did; every prefetched byte is read once, whatever the number of readers."""
    import threading

    from lightning_horizon.store.sizes import WEIGHT

    model = _stack(4)
    store = StateStore(str(tmp_path), plan_units(model), "read", readers, training_state=TrainingState())
    store.install()
    streamed = [u for u in store.units if u.streamed]
    try:
        def cold() -> None:  # every unit's weights on the disk only
            store.mark_dirty([u.index for u in streamed], (WEIGHT,))
            for u in streamed:
                store.release(u, (WEIGHT,))
            store.drain()

        cold()
        for u in streamed:
            store.prefetch(u, (WEIGHT,))
        store.drain()
        alone = list(store.reads["alone"])
        if alone[0] == 0:
            pytest.skip("this file system reports no disk reads (/proc/thread-self/io)")
        assert alone[1] > 0 and store.reads["shared"] == [0, 0.0]
        cold()
        started, release = threading.Event(), threading.Event()
        store._write_back(lambda: (started.set(), release.wait(10)))  # a write-back in progress
        assert started.wait(10)
        for u in streamed:
            store.prefetch(u, (WEIGHT,))
        for u in streamed:
            for job in store._inflight[u.index]:
                job.result()
        release.set()
        store.drain()
        assert store.reads["alone"] == alone and store.reads["shared"][0] > 0 and store.reads["shared"][1] > 0
    finally:
        store.uninstall()
    for p, q in zip(model.parameters(), _stack(4).parameters()):
        assert torch.equal(p, q)


def _stack(n: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(n)], nn.Linear(8, 2))


@pytest.mark.parametrize("in_backward", [False, True])
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1),
])
def test_layer_by_layer_step_is_the_whole_step(tmp_path, make, in_backward):
    """StreamedStep steps unit by unit (after backward, or in backward as each unit's gradients are complete),
    state in the store, and computes exactly what one step computes; step hooks fire once per step (in backward:
    the pre-hooks with the first unit, inside backward), a scheduler's wrapper of ``step`` is kept and put back."""
    ref, mod = _stack(), _stack()
    state = TrainingState()
    store = StateStore(str(tmp_path), plan_units(mod), "read", training_state=state)
    store.install()
    state.store = store
    opt_ref, opt = make(ref.parameters()), make(mod.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)  # wraps opt.step (an instance attribute)
    wrapped = opt.__dict__["step"]
    calls = []
    during_backward = torch._C._current_graph_task_id
    opt.register_step_pre_hook(lambda *a: calls.append(("pre", during_backward() != -1)))
    opt.register_step_post_hook(lambda *a: calls.append(("post", during_backward() != -1)))
    streamed = StreamedStep(opt, store, state, in_backward)
    x = torch.randn(16, 8)

    def closure(m: nn.Module, o: Any) -> Any:
        def run() -> Tensor:
            o.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            return loss
        return run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for m, o in ((ref, opt_ref), (mod, opt)):
                o.step(closure(m, o))
            sched.step()
            opt_ref.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
    assert calls == [("pre", in_backward), ("post", False)] * 3  # once per step
    assert not caught  # no "step() overridden after the scheduler" warning
    for a, b in zip(ref.parameters(), mod.parameters()):
        assert torch.equal(a, b)
    views = {v.data_ptr() for v in store._views.values()}
    assert all(p.data_ptr() in views for p in mod.parameters())
    assert all(v.data_ptr() in views for st in opt.state.values() for v in st.values() if v.dim() > 0)
    assert os.listdir(tmp_path) == []  # every file unlinked at creation
    streamed.remove()
    assert opt.__dict__["step"] is wrapped
    store.uninstall()
    assert all(p.data_ptr() not in views for p in mod.parameters())  # private memory again


def test_step_in_parts_restores_groups_and_hooks():
    p = [nn.Parameter(torch.ones(2)) for _ in range(3)]
    opt = torch.optim.SGD([{"params": p[:2]}, {"params": p[2:]}], lr=1.0)
    seen = []
    for q in p:
        q.grad = torch.ones(2)

    def one(part):
        for i, q in part:
            opt.param_groups[i]["params"].append(q)
        seen.append([len(g["params"]) for g in opt.param_groups])
        return opt.step()

    step_in_parts(opt, [[(0, p[0])], [(0, p[1]), (1, p[2])]], one)
    assert seen == [[1, 0], [1, 1]] and [len(g["params"]) for g in opt.param_groups] == [2, 1]
    assert all(torch.equal(q, torch.zeros(2)) for q in p)


def _fit(tmp: Path, store: Any, steps: int = 2, callbacks=(), model: Any = None) -> L.LightningModule:
    from lightning.pytorch.demos.boring_classes import BoringModel

    model = model or BoringModel()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HorizonStrategy(state_store=store), max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp), callbacks=list(callbacks))
    trainer.fit(model)
    return model


def test_step_in_backward_refused_by_name_where_something_is_in_the_way(tmp_path):
    """``step="in_backward"`` with what needs the whole gradient before the step fails at setup, naming each."""
    seen = _Before()
    with pytest.raises(ValueError) as err:
        _fit(tmp_path, StoreConfig(path=str(tmp_path / "s"), probe_bytes=0, step="in_backward"),
             callbacks=[seen, GradNormBackoff(max_norm=1.0)])
    assert "StoreConfig(step='in_backward')" in str(err.value) and "GradNormBackoff.on_before_optimizer_step" in str(
        err.value) and "'auto'" in str(err.value), str(err.value)
    assert not seen.stepped

    class PreHooked(L.LightningModule):  # BoringModel's, with a step pre-hook on its optimizer
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(32, 2)

        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            return self.layer(batch).sum()

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.randn(8, 32), batch_size=2)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            opt.register_step_pre_hook(lambda *a: None)
            return opt

    with pytest.raises(ValueError, match="a step pre-hook on SGD"):
        _fit(tmp_path, StoreConfig(path=str(tmp_path / "s"), probe_bytes=0, step="in_backward"), model=PreHooked())


class _ClosureOptimizer(torch.optim.SGD):
    """A user's optimizer whose step needs the closure (as LBFGS's: it may evaluate it several times)."""

    def step(self, closure: Any) -> Any:  # type: ignore[override]
        loss = closure()
        super().step()
        return loss


@pytest.mark.parametrize("make", [lambda ps: torch.optim.LBFGS(ps, lr=0.5, max_iter=3),
                                  lambda ps: _ClosureOptimizer(ps, lr=0.1)], ids=["LBFGS", "user"])
def test_an_optimizer_whose_step_needs_the_closure_is_refused_at_setup(tmp_path, make):
    """The streamed step runs the closure once and steps layer by layer; LBFGS re-evaluates it inside its step."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Model(BoringModel):
        def configure_optimizers(self) -> Any:
            return make(self.parameters())

    seen = _Before()
    with pytest.raises(ValueError) as err:
        _fit(tmp_path, StoreConfig(path=str(tmp_path / "s"), probe_bytes=0), callbacks=[seen], model=Model())
    name = type(make([nn.Parameter(torch.zeros(1))])).__name__
    assert all(n in str(err.value) for n in ("state_store=", name, "closure", "state_store=None")), str(err.value)
    assert not seen.stepped


class _Before(L.Callback):
    def __init__(self) -> None:
        self.stepped = False

    def on_train_batch_start(self, *a: Any) -> None:
        self.stepped = True


def test_unwritable_folder_fails_at_setup(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    seen = _Before()
    with pytest.raises(StoreSpaceError, match=f"cannot create the folder {blocker}/store"):
        _fit(tmp_path, StoreConfig(path=str(blocker / "store"), probe_bytes=0), callbacks=[seen])
    assert not seen.stepped


@contextlib.contextmanager
def _small_disk(tmp_path: Path, size: str) -> Any:
    """A folder on a tmpfs of ``size`` (as root: mount needs it), unmounted afterwards."""
    folder = tmp_path / f"disk-{size}"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], check=False)  # busy: detached now, freed when released


def test_full_disk_fails_at_setup(tmp_path):
    """A 1 MiB tmpfs cannot take the store: setup fails naming the folder and the bytes, before any step, and
    leaves nothing in the folder."""
    with _small_disk(tmp_path, "1m") as folder:
        seen = _Before()
        sys.path.insert(0, str(REPO))
        from tests.scripts.composition_models import build

        big = build("gpt", "automatic")
        big.net = nn.Linear(512, 512)  # 1 MiB of weights: the weights fit nowhere near, gradients and state neither
        with pytest.raises(StoreSpaceError) as err:
            _fit(tmp_path, StoreConfig(path=str(folder), probe_bytes=0), callbacks=[seen], model=big)
        assert str(folder) in str(err.value) and "free" in str(err.value), str(err.value)
        assert not seen.stepped
        assert os.listdir(folder) == []


class _Wide(L.LightningModule):
    """Three Linear(128, 128) units (208 KiB of fp32 weights in the store) and ``optimizer``."""

    def __init__(self, optimizer: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(3)], nn.Linear(128, 2))
        self.make = optimizer

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.net(batch).square().mean()

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.randn(16, 128), batch_size=4)

    def configure_optimizers(self) -> Any:
        return self.make(self.parameters())


def test_a_disk_short_of_the_optimizer_state_fails_at_setup(tmp_path):
    """RMSprop(centered=True, momentum=0.9) keeps three state tensors per parameter: 208 KiB of weights, 208 KiB of
    gradients and 624 KiB of state do not fit on 800 KiB, and setup says so (folder, bytes needed, bytes free, the
    state), before any step; on 1100 KiB the fit trains."""
    rmsprop = functools.partial(torch.optim.RMSprop, lr=0.01, centered=True, momentum=0.9)
    with _small_disk(tmp_path, "800k") as folder:
        seen = _Before()
        with pytest.raises(StoreSpaceError) as err:
            _fit(tmp_path, StoreConfig(path=str(folder), probe_bytes=0), callbacks=[seen], model=_Wide(rmsprop))
        message = str(err.value)
        assert not seen.stepped, message
        assert all(s in message for s in (str(folder), "832 KiB", "free there", "RMSprop: grad_avg, momentum_buffer,"
                                          " square_avg")), message
        assert os.listdir(folder) == []
    with _small_disk(tmp_path, "1100k") as folder:
        _fit(tmp_path, StoreConfig(path=str(folder), probe_bytes=0), steps=2, model=_Wide(rmsprop))
        assert os.listdir(folder) == []


class _Disk(L.Callback):
    def on_train_start(self, trainer: L.Trainer, *a: Any) -> None:
        self.disk = trainer.strategy.store.disk


def test_the_disk_probe_fits_itself_to_the_space_left(tmp_path):
    """On an 8 MiB disk the default probe (2 x 128 MiB) shrinks to what is free and measures; on 2 MiB, room for the
    store but not for the smallest probe, setup fails naming StoreConfig(probe_bytes=...), the folder and the bytes
    free. No probe file stays behind either way."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    with _small_disk(tmp_path, "8m") as folder:
        disk = _Disk()
        _fit(tmp_path, StoreConfig(path=str(folder)), callbacks=[disk])
        assert disk.disk is not None and disk.disk.read > 0 and disk.disk.write > 0
        assert os.listdir(folder) == []
    with _small_disk(tmp_path, "2m") as folder:
        seen = _Before()
        with pytest.raises(StoreSpaceError) as err:
            _fit(tmp_path, StoreConfig(path=str(folder)), callbacks=[seen], model=BoringModel())
        message = str(err.value)
        assert not seen.stepped, message
        assert all(s in message for s in (f"StoreConfig(probe_bytes={128 << 20})", str(folder), "free there",
                                          "probe_bytes=0")), message
        assert os.listdir(folder) == []


class _NaNAt(L.Callback):
    """The loss becomes NaN at training step ``at``; the store's bytes (everything but the gradients) are copied
    at the end of every step."""

    def __init__(self, at: int) -> None:
        self.at, self.snapshots = at, {}

    def on_train_batch_end(self, trainer, pl_module, *a):
        store = trainer.strategy.store.store
        self.snapshots[trainer.global_step] = {k: v.clone() for k, v in store._views.items() if k[1] != "grad"}


def test_a_skipped_step_leaves_the_store_untouched(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    class NaNModel(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            if self.trainer.global_step == 2:
                out["loss"] = out["loss"] * float("nan")
            return out

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.1)

    nan, backoff = _NaNAt(2), GradNormBackoff(max_norm=1.0)
    _fit(tmp_path, StoreConfig(path=str(tmp_path / "s"), probe_bytes=0), steps=4, callbacks=[nan, backoff],
         model=NaNModel())
    assert backoff.states[0].skipped_steps == 1
    before, after, later = nan.snapshots[2], nan.snapshots[3], nan.snapshots[4]
    assert before.keys() == after.keys() and any(k[1].startswith("state.") for k in before)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the skipped step wrote nothing
    assert not all(torch.equal(after[k], later[k]) for k in after)  # the next one did


# ---------------------------------------------------------------------------------------------- fits, paired

#: every valid pair of these values is one store fit compared with its in-RAM twin (tests/pairwise.py)
DIMENSIONS = {
    "precision": ("32-true", "bf16-mixed", "bf16-true+fp32", "bf16-true+kahan"),
    # manual: two optimizers (SGD, AdamW) in one step; manual-twice: two backward passes before the step
    "optimization": ("automatic", "accumulate", "manual", "manual-twice"),
    "backoff": (False, True),  # GradNormBackoff (clips); a NaN at step 1 (a skipped step), a spike at step 2
    "scheduler": (False, True),  # LambdaLR
    "sharding": (None, "forced"),  # activation recompute (a unit's weights come back in backward)
    "model": ("gpt", "transformer", "tied", "generator", "batchnorm", "boring"),  # + Lightning's demo models
    "prefetch": ("read", "readahead", "none"),
    # when the step runs: "auto" steps in backward where nothing is in the way (the fit then leaves out its checks
    # between backward and the step)
    "step": ("auto", "after_backward"),
}
PRECISION = {"32-true": "32-true", "bf16-mixed": {"mode": "bf16-mixed", "compute": "fp32"},
             "bf16-true+fp32": {"mode": "bf16-true", "master": "fp32", "compute": "fp32"},
             "bf16-true+kahan": {"mode": "bf16-true", "master": "kahan", "compute": "fp32"}}


def valid(case: dict) -> bool:
    return not (str(case.get("optimization", "")).startswith("manual") and case.get("scheduler"))


def case_name(case: dict) -> str:
    named = {**case, "backoff": case["backoff"] and "backoff", "scheduler": case["scheduler"] and "scheduler",
             "sharding": case["sharding"] and "recompute"}
    return "-".join(str(named[d]) for d in DIMENSIONS if named[d])


CASES: dict[str, dict] = {case_name(c): c for c in all_pairs(DIMENSIONS, valid)}
# the step in backward with what pairs alone leave out of it: recompute, a scheduler, tied and generator models
CASES.update({f"in-backward-{i}": dict(zip(DIMENSIONS, c)) for i, c in enumerate([
    ("32-true", "automatic", False, True, "forced", "tied", "read", "auto"),
    ("bf16-mixed", "accumulate", False, False, "forced", "generator", "readahead", "auto"),
    ("32-true", "automatic", False, True, None, "batchnorm", "none", "auto"),
])})
# 2 gloo ranks (DDP averages the gradients the store holds): plain, and the busiest combination
WORLD2 = {"w2-gpt": {**dict(zip(DIMENSIONS, ("32-true", "automatic", False, False, None, "gpt", "read", "auto"))),
                    "readers": 1},  # one reading thread (every other case: StoreConfig's default)
          "w2-busy": {**dict(zip(DIMENSIONS, ("bf16-true+kahan", "accumulate", True, True, "forced", "tied",
                                             "readahead", "auto")))}}


def run(name: str, case: dict, world: int, store: Any, work: Path, **extra: Any) -> dict:
    precision = case["precision"]
    strategy = {}
    if store:
        strategy["state_store"] = {"path": str(work / "stores" / name), "prefetch": case["prefetch"], "probe_bytes": 0,
                                   "step": case["step"], **({"readers": case["readers"]} if "readers" in case else {})}
    return {"name": f"{name}-{'store' if store else 'ram'}", "model": case["model"],
            "optimization": case["optimization"], "world": world, "ranks_per_node": world,
            "precision": PRECISION.get(precision, precision), "strategy": strategy, "sharding": case["sharding"],
            "backoff": case["backoff"], "scheduler": case["scheduler"], "steps": STEPS, "epoch_steps": SAVE_AT,
            "backward_hooks": case["step"] != "auto", **extra}


CKPT = {**dict(zip(DIMENSIONS, ("bf16-true+fp32", "automatic", False, False, None, "gpt", "read", "auto")))}


def world(work: Path, tag: str, runs: list[dict], devices: int) -> dict:
    """A job of the launch: a world of ``devices`` ranks running ``runs`` (tests/scripts/composition_fit.py)."""
    cfg = work / f"{tag}.json"
    cfg.write_text(json.dumps({"runs": runs}))
    return {"tag": tag, "devices": devices, "config": str(cfg)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Any]:
    """Every multi-process check of this file in one launch (one process start; its jobs, one after another, in
    processes it forks after its imports): the paired fits at 1 rank, ending with a SIGKILL; the resumes; the paired
    fits at 2 ranks; two fits sharing a folder at once."""
    work = tmp_path_factory.mktemp("out_of_core")
    (work / "stores").mkdir()
    runs = [run(name, case, 1, store, work) for name, case in CASES.items() for store in (True, False)]
    # a checkpoint at step 2 (bf16-true + fp32 masters: masters and optimizer state in the store), resumed
    runs.append(run("ckpt", CKPT, 1, True, work, save_at=SAVE_AT))
    runs.append(run("ckpt", CKPT, 1, False, work, save_at=SAVE_AT))
    # a crash: SIGKILL at step 3, after the checkpoint of step 2, as the world's last run (each run before it has
    # written its results as it ended); then resume from it, and from the whole run's checkpoint
    killed = run("killed", CKPT, 1, True, work, save_at=SAVE_AT, kill_at=SAVE_AT + 1)
    ckpt = work / "ckpt-store.ckpt" / f"step={SAVE_AT}.ckpt"
    resumed = [run("resume", CKPT, 1, True, work, resume_from=str(ckpt)),
               run("resume-killed", CKPT, 1, True, work,
                   resume_from=str(work / "killed-store.ckpt" / f"step={SAVE_AT}.ckpt"))]
    w2 = [run(name, case, 2, store, work) for name, case in WORLD2.items() for store in (True, False)]
    shared = {"folder": str(work / "shared"), "sync": str(work / "sync"),
              "out": {role: str(work / f"shared-{role}.pt") for role in ("first", "second")}}
    for folder in ("shared", "sync"):
        (work / folder).mkdir()
    jobs = [world(work, "w1", [*runs, killed], 1), world(work, "resume", resumed, 1), world(work, "w2", w2, 2),
            {"tag": "shared", "shared": shared}]
    (work / "jobs.json").write_text(json.dumps({"jobs": jobs}))
    launched = run_script(FITS, [work / "jobs.json", work], timeout=900)
    exits = {j["tag"]: j["exit"] for j in map(json.loads, (work / "exits.jsonl").read_text().splitlines())}
    assert exits == {"w1": [-9], "resume": [0], "w2": [0, 0], "shared": [0, 0]}, (exits, launched.stdout[-6000:])
    w1_log = (work / "w1.log").read_text()
    assert f"KILLED at step {SAVE_AT + 1}" in w1_log and "RUN killed-store ok" not in w1_log
    loaded: dict[str, Any] = {"_work": work}
    for r in runs + resumed + w2:
        loaded[r["name"]] = [torch.load(work / f"{r['name']}.rank{k}.pt", weights_only=False)
                             for k in range(r["world"])]
        for res in loaded[r["name"]]:
            assert res["error"] is None, f"{r['name']}: {res['error']}\n{res.get('traceback', '')}"
            assert not res["violations"], res["violations"]
    loaded["_shared"] = {role: torch.load(path, weights_only=False) for role, path in shared["out"].items()}
    return loaded


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def in_backward(case: dict, world: int = 1) -> bool:
    """Whether the store's "auto" step runs in backward for ``case``: nothing between backward and the step."""
    return (case["step"] == "auto" and world == 1 and not case["backoff"]
            and case["optimization"] in ("automatic", "accumulate") and case["precision"] in ("32-true", "bf16-mixed"))


def check_pair(store: list[dict], ram: list[dict], case: dict, world: int = 1) -> None:
    for s, r in zip(store, ram):
        assert s["in_backward"] is in_backward(case, world)
        assert s["global_step"] == r["global_step"]
        assert s["rows"].keys() == r["rows"].keys()
        for step in r["rows"]:  # bitwise, after every optimizer step
            assert same(s["rows"][step], r["rows"][step]), step
        assert same(s["final"], r["final"]) and same(s["buffers"], r["buffers"])
        assert list(map(repr, s["losses"])) == list(map(repr, r["losses"]))  # NaN (the injected one) included
        if case["backoff"]:
            assert (s["skipped"], s["spikes"], s["lr_scale"]) == (r["skipped"], r["spikes"], r["lr_scale"])
            assert sum(s["skipped"]) >= 1
        # the store really held the training state: every parameter and optimizer state tensor was a view of its
        # files during the fit (the twins being equal would prove nothing otherwise)
        assert s["store_holds"] == [True, True] and {"weight", "grad", "state"} <= set(s["store_kinds"])
        assert r["store_kinds"] == []


@pytest.mark.parametrize("name", list(CASES))
def test_store_fit_is_bitwise_the_ram_fit(results, name):
    check_pair(results[f"{name}-store"], results[f"{name}-ram"], CASES[name])
    assert not (results["_work"] / "stores" / name).exists()  # removed at teardown (its files were unlinked)


@pytest.mark.parametrize("name", list(WORLD2))
def test_two_ranks_bitwise(results, name):
    check_pair(results[f"{name}-store"], results[f"{name}-ram"], WORLD2[name], world=2)


def test_resume_exact_also_after_a_kill(results):
    whole, ram = results["ckpt-store"][0], results["ckpt-ram"][0]
    assert same(whole["final"], ram["final"])
    assert "master" in whole["store_kinds"]
    for name in ("resume-store", "resume-killed-store"):
        resumed = results[name][0]
        assert resumed["global_step"] == whole["global_step"]
        assert same(resumed["final"], whole["final"]), name  # bitwise
        assert resumed["losses"] == whole["losses"][SAVE_AT:], name
    # the killed run left no file behind: its subfolder, empty, at most (the next fit there removes it)
    left = list((results["_work"] / "stores" / "killed").iterdir())
    assert len(left) <= 1 and all(d.is_dir() and not any(d.iterdir()) for d in left), left


# ---------------------------------------------------------------------------------------------- memory


def test_peak_memory_is_a_layer_not_the_state(tmp_path):
    """A GPT whose gradients and AdamW state take 76 MB: in RAM the peak grows by that (and the activations, code
    pages) during training; with the store by a few layers' worth less than that: what streaming saves is most of
    the state (fresh processes, peak RSS = VmHWM, file-backed pages included; glibc's mmap threshold fixed in both,
    so that freed buffers leave the process). One launch: each arm twice, each time in a child forked from it after
    the imports; each arm's smaller figures count."""
    out = run_script(MEMORY, [tmp_path], timeout=480, env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    runs = {arm: [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines()
                  if line.startswith(f"{arm} {{")] for arm in ("ram", "store")}
    assert all(len(r) == 2 for r in runs.values()), out.stdout[-3000:]
    # each arm's smallest peak of its two runs: what else runs on the machine only ever raises a peak
    figures = {arm: {k: min(r[k] for r in rs) for k in rs[0]} for arm, rs in runs.items()}
    added = figures["ram"]["added"]
    assert figures["ram"]["grown"] >= added, figures  # the gradients and the state, plus activations and code pages
    # the same fit with the store: everything but what the gradients and the state take (measured: 86% of them)
    assert figures["ram"]["grown"] - figures["store"]["grown"] >= 0.6 * added, figures
    # teardown gives the weights private memory back one unit at a time and leaves the gradients in the store
    assert figures["ram"]["after"] - figures["store"]["after"] >= 0.5 * added, figures
    assert figures["store"]["loss"] == figures["ram"]["loss"]


def test_units_are_pinned_as_measured_memory_allows(tmp_path):
    """With a sharding budget far above the measured peak the store keeps units' weights mapped, the last units first,
    one per measured step; a budget squeezed below the peak gives them back. Values do not change (the pairwise
    cases with recompute run through both)."""
    sys.path.insert(0, str(REPO))
    from lightning_horizon.sharding import ShardingConfig
    from tests.scripts.composition_models import build

    pinned = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *a):
            store = trainer.strategy.store
            pinned.append(sorted(store.store.pinned))
            if trainer.global_step == 8:  # squeeze: every measured step is now above the headroom
                trainer.strategy.sharder.budget = trainer.strategy.sharder.last_peak // 2

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=14, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Watch()],
                        strategy=HorizonStrategy(state_store=StoreConfig(path=str(tmp_path / "s"), probe_bytes=0),
                                                 sharding=ShardingConfig(budget=1 << 40, adaptive=False),
                                                 threads_per_rank=1))
    sys.path.insert(0, str(REPO))
    from tests.scripts.composition_models import BATCH, dataset

    trainer.fit(build("gpt", "automatic"), torch.utils.data.DataLoader(dataset("gpt", 64), batch_size=BATCH))
    first = next(p for p in pinned if p)
    assert pinned[0] == [] and first == [1]  # after a measured step, not before; the last unit (of 2) first
    assert [0, 1] in pinned[:9]  # then the one before it
    assert pinned[-1] == []  # squeezed: given back
    assert trainer.strategy.store is None  # the part is gone after fit


# ---------------------------------------------------------------------------------------------- in-process fits


@pytest.fixture(scope="module")
def ram_fit(tmp_path_factory) -> Any:
    """``ram_fit(kind, used_in, unused=True)``: the in-RAM fit of ``Partial(kind, used_in, unused)`` (its weights and
    losses), fitted once for every test that compares a store fit with it."""
    fitted: dict[tuple, tuple[dict[str, Tensor], list[float]]] = {}

    def fit(kind: str, used_in: tuple[int, ...], unused: bool = True) -> tuple[dict[str, Tensor], list[float]]:
        key = (kind, used_in, unused)
        if key not in fitted:
            model = Partial(kind, used_in, unused=unused)
            fitted[key] = accumulated_fit(tmp_path_factory.mktemp("ram"), model, None), model.losses
        return fitted[key]

    return fit


@pytest.mark.parametrize("step", ["in_backward", "after_backward"])
@pytest.mark.parametrize("kind", ["gpt", "linear"])
def test_accumulation_with_parameters_without_gradient_is_bitwise_the_ram_fit(tmp_path, ram_fit, kind, step):
    """Gradient accumulation over 2 micro-batches, each unit with a parameter that never gets a gradient and one
    that gets one in the first micro-batch only, the second only, or both: a unit steps once its gradients of the
    step are complete (in the last micro-batch's backward, or after it), and the fit is the in-RAM fit, bitwise."""
    for used_in in ((0,), (1,), (0, 1)):
        want, losses = ram_fit(kind, used_in)
        store = Partial(kind, used_in)
        steps = StepsInBackward()
        got = accumulated_fit(tmp_path, store, StoreConfig(path=str(tmp_path / "s"), probe_bytes=0, step=step),
                               [steps])
        assert steps.seen == [step == "in_backward"] * 3  # the last unit (one never complete) stepped in backward
        assert store.losses == losses, used_in
        assert all(torch.equal(want[n], got[n]) for n in want), (used_in, [n for n in want if not torch.equal(
            want[n], got[n])])
        assert not torch.equal(want["net.0.sometimes" if kind == "linear" else "net.blocks.0.sometimes"],
                               torch.ones(8))  # it trained


# ---------------------------------------------------------------------------------------------- the disk at setup


class _Signum(torch.optim.Optimizer):
    """A user's optimizer: an attribute of its own, read in step, and state of its own (a momentum in fp32 and a
    0-dim counter)."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})
        self.beta = 0.9

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["m"], st["n"] = torch.zeros_like(p, dtype=torch.float32), torch.zeros(())
                st["m"].mul_(self.beta).add_(p.grad)
                st["n"] += 1
                p.add_(st["m"].sign(), alpha=-g["lr"])
        return loss


@pytest.mark.parametrize("make, per_param", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 0),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
    (lambda ps: torch.optim.Adam(ps, lr=0.1), 2),
    (lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True), 3),
    (lambda ps: torch.optim.RMSprop(ps, lr=0.01, centered=True, momentum=0.9), 3),
    (lambda ps: torch.optim.Adagrad(ps, lr=0.1), 1),  # its state exists from construction on
    (lambda ps: torch.optim.Adafactor(ps, lr=0.1), None),  # factored: per element only for 1-D parameters
    (lambda ps: _Signum(ps), 1),
    (lambda ps: torch.optim.SGD([{"params": ps[:3]}, {"params": ps[3:], "momentum": 0.9}], lr=0.1), None),
])
def test_reserved_disk_is_what_the_first_step_creates(tmp_path, make, per_param):
    """The disk reserved at setup is, to the byte, what the first backward and step create in the store: the
    gradients and each per-element state tensor the optimizer really keeps (learned from a step of a copy of it);
    learning it changes nothing of the fit (weights, state, random stream)."""
    from lightning_horizon.store.reserve import state_kinds

    ref, mod = _stack(), _stack()
    state = TrainingState()
    store = StateStore(str(tmp_path), plan_units(mod), "none", training_state=state)
    store.install()
    state.store = store
    opt_ref, opt = make(list(ref.parameters())), make(list(mod.parameters()))
    rng = torch.get_rng_state()
    grads, reserved = store.pending(state_kinds(opt, state))
    assert torch.equal(torch.get_rng_state(), rng) and not any(opt.state[p] for p in mod.parameters()
                                                               if not isinstance(opt, torch.optim.Adagrad))
    StreamedStep(opt, store, state)
    x = torch.randn(16, 8)
    for m, o in ((ref, opt_ref), (mod, opt)):
        def closure(m: nn.Module = m) -> Tensor:
            loss = m(x).square().mean()
            loss.backward()
            return loss
        o.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), mod.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(ref.parameters(), _stack().parameters()))  # it stepped
    made = store.nbytes()
    assert (made["grad"], made.get("state", 0)) == (grads, reserved)
    if per_param is not None:  # fp32 throughout: each state tensor takes what the gradients take
        assert reserved == per_param * grads
    store.uninstall()


def test_a_failing_copy_step_is_refused_by_name(tmp_path):
    from lightning_horizon.store.reserve import state_kinds

    model = _stack()
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.1)  # dense gradients refused
    with pytest.raises(ValueError, match="state_store: cannot learn which state SparseAdam keeps per parameter"):
        state_kinds(opt, TrainingState())
    assert not opt.state and all(p.grad is None for p in model.parameters())


class _Made(L.Callback):
    """The store's bytes of gradients and optimizer state after the first step, and what setup reserved for them."""

    def on_train_batch_end(self, trainer: L.Trainer, *a: Any) -> None:
        part = trainer.strategy.store
        made = part.store.nbytes()
        self.made, self.reserved, self.kinds = (made["grad"], made.get("state", 0)), part.reserved, part.state_kinds


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "fp32", "kahan"])
def test_reserved_disk_is_exact_with_every_precision(tmp_path, precision):
    """fp32 masters keep their state in fp32, Kahan in bf16: what setup reserves is what the first step makes."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_horizon import HorizonPrecision

    class Stack(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.layer = _stack()  # BoringModel's step: its (32 -> 2) layer on a batch of 32 features
            self.layer[0][0] = nn.Linear(32, 8)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.1)

    made = _Made()
    plugin = ({"precision": precision} if precision in ("32-true", "bf16-mixed") else
              {"plugins": [HorizonPrecision(mode="bf16-true", master=precision, compute="fp32")]})
    L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
              callbacks=[made], strategy=HorizonStrategy(state_store=StoreConfig(path=str(tmp_path / "s"),
                                                                                 probe_bytes=0)),
              **plugin).fit(Stack())
    assert made.made == made.reserved and made.reserved[1] > made.reserved[0], (made.made, made.reserved)
    assert made.kinds == "AdamW: exp_avg, exp_avg_sq"


# ---------------------------------------------------------------------------------------------- a shared folder


def test_fits_sharing_a_folder_one_after_another(tmp_path, ram_fit):
    """Two fits with the same ``StoreConfig(path=...)``, a folder the user made: each trains as in RAM, works in a
    subfolder of its own and removes it; the user's folder and the user's file in it stay."""
    folder = tmp_path / "mine"
    folder.mkdir()
    want, _ = ram_fit("linear", (0, 1), unused=False)
    for i in range(2):
        got = accumulated_fit(tmp_path, Partial("linear", (0, 1), unused=False),
                              StoreConfig(path=str(folder), probe_bytes=0))
        assert all(torch.equal(want[n], got[n]) for n in want), i
        assert folder.is_dir() and os.listdir(folder) == ([] if i == 0 else ["notes.txt"]), i
        (folder / "notes.txt").write_text("mine")
    assert (folder / "notes.txt").read_text() == "mine"


def test_fits_sharing_a_folder_at_once(results, ram_fit):
    """Two processes' fits in one folder at the same time (a job of the launch of ``results``): the first tears down
    (at its first batch, the second's store is set up) while the second waits at its first batch, then the second
    trains. Both train as in RAM; the folder stays."""
    want, _ = ram_fit("linear", (0, 1), unused=False)
    for role, got in results["_shared"].items():
        assert got["error"] is None, f"{role}: {got['error']}"
        assert all(torch.equal(want[n], got["weights"][n]) for n in want), role
    folder = results["_work"] / "shared"
    assert folder.is_dir() and os.listdir(folder) == []


def test_a_crashed_fits_subfolder_is_swept_by_the_next(tmp_path):
    """A fit that died (its lock gone with its process) leaves an empty subfolder at most, or a file a crash caught
    before its unlink: the next fit in the folder on this host removes them; a live fit's subfolder, another host's
    and the user's own folders and files stay."""
    from lightning_horizon.store.folder import FitFolder

    parent = tmp_path / "store"
    dead, live = FitFolder(str(parent), 0), FitFolder(str(parent), 1)
    Path(dead.path, "unit0-grad-1.bin").write_bytes(b"x")
    os.close(dead._fd)  # what the kernel does when the process dies
    for name in ("horizon-otherhost-rank0-abc", "user"):
        (parent / name).mkdir()
    (parent / "user.txt").write_text("")
    new = FitFolder(str(parent), 0)
    assert sorted(os.listdir(parent)) == sorted(["horizon-otherhost-rank0-abc", "user", "user.txt",
                                                 os.path.basename(live.path), os.path.basename(new.path)])
    assert new.created == [] and Path(new.path).parent == parent
    for f in (new, live):
        f.remove()
    assert sorted(os.listdir(parent)) == ["horizon-otherhost-rank0-abc", "user", "user.txt"]
    made = FitFolder(str(tmp_path / "a" / "b"), 0)  # the store makes what is missing and removes it after
    assert made.created == [str(tmp_path / "a"), str(tmp_path / "a" / "b")]
    made.remove()
    assert not (tmp_path / "a").exists()


# ---------------------------------------------------------------------------------------------- models declared on meta


@pytest.fixture(scope="module")
def ram_declared(tmp_path_factory):
    """The in-RAM fits the meta-declared ones must equal: each model built by its own __init__ (4 steps)."""
    from tests.scripts.out_of_core_meta import declared_fit

    return {kind: declared_fit(tmp_path_factory.mktemp(f"ram-{kind}"), kind, "init", store=False, steps=4)
            for kind in ("gpt", "llama")}


def _same(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind, where", [("gpt", "init"), ("gpt", "configure"), ("llama", "init")])
def test_a_meta_declared_model_is_built_into_the_store_bitwise(tmp_path, ram_declared, kind, where):
    """Declared on the meta device (trainer.init_module(empty_init=True), configure_model; the recipe GPT and a tiny
    Hugging Face Llama from its config), built layer by layer into the store at setup: the init is the in-RAM one
    bit for bit, the generator is where the in-RAM build leaves it (the loader shuffles with it), and 4 steps train
    to the in-RAM weights and losses, bit for bit."""
    from tests.scripts.out_of_core_meta import declared_fit

    ram = ram_declared[kind]
    fit = declared_fit(tmp_path, kind, where, store=True, steps=4)
    assert fit["declared_on_meta"] and fit["in_store"] and fit["materialized"]
    assert _same(fit["start"], ram["start"])
    assert torch.equal(fit["rng"], ram["rng"])
    assert fit["losses"] == ram["losses"]
    assert _same(fit["end"], ram["end"])


def test_a_meta_declared_model_saves_resumes_and_loads_without_being_built(tmp_path, ram_declared):
    """Saved at step 2 and resumed to step 4 (declared on the meta device both times: weights and optimizer state go
    into the store unit by unit), the weights equal the uninterrupted fit's; the checkpoint loads into the plain
    model declared on meta (its tensors the memory-mapped file's) and converts to safetensors, tensor by tensor,
    which StoreConfig(pretrained=...) reads back into the store."""
    from lightning_horizon.store import deferred_init, load_weights, to_safetensors
    from tests.scripts.out_of_core_meta import Declared, declared_fit, make_net

    ram = ram_declared["llama"]
    full = str(tmp_path / "full.ckpt")
    declared_fit(tmp_path / "a", "llama", "init", store=True, steps=3, every=2)
    half = str(tmp_path / "a" / "ckpt" / "step=2.ckpt")
    resumed = declared_fit(tmp_path / "b", "llama", "init", store=True, steps=4, ckpt=half, save=full)
    assert resumed["materialized"] and _same(resumed["end"], ram["end"])
    assert resumed["losses"] == ram["losses"][2:]
    # after fit the parameters still view the store's files: the model was never given private memory
    assert not any(f.endswith(".tmp") for f in os.listdir(tmp_path / "a" / "ckpt"))
    with deferred_init():
        plain = make_net("llama")
    load_weights(plain, full, prefix="net.")
    assert _same({f"net.{k}": v for k, v in plain.named_parameters()}, ram["end"])
    assert not any(b.is_meta for b in plain.buffers())
    reference = Declared("llama")
    reference.load_state_dict(ram["end"], strict=False)
    x = torch.randint(0, 32, (2, 8))
    assert torch.equal(plain(input_ids=x).logits, reference.net(input_ids=x).logits)
    weights = str(tmp_path / "net.safetensors")
    assert to_safetensors(full, weights, prefix="net.") == len(plain.state_dict())
    loaded = declared_fit(tmp_path / "c", "llama", "init", store=True, steps=1, pretrained=weights)
    assert _same(loaded["start"], ram["end"])


def test_a_model_built_whole_that_cannot_fit_fails_at_setup(tmp_path):
    """A model whose __init__ built more weights than the sharding budget fails at setup with one line naming the
    fix (declare it in configure_model / under init_module(empty_init=True)); nothing was copied into the store."""
    from lightning_horizon.sharding import ShardingConfig
    from tests.scripts.out_of_core_meta import too_big

    with pytest.raises(MemoryError) as err:
        too_big(str(tmp_path / "store"), 64 << 20, sharding=ShardingConfig(budget=48 << 20))
    message = str(err.value)
    assert "\n" not in message and "built its weights in memory (64 MiB)" in message, message
    assert "the sharding budget" in message and "configure_model" in message and "empty_init=True" in message
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())


def _memory_cgroup() -> Optional[Path]:
    root = Path("/sys/fs/cgroup/memory")
    if os.geteuid() != 0 or not (root / "cgroup.procs").exists():
        return None
    return root


def test_under_a_memory_limit_a_model_built_whole_fails_at_setup(tmp_path):
    """In a memory cgroup (v1, as root) of 700 MiB, a model whose __init__ built 1 GiB of weights (untouched pages,
    so it got that far) fails at setup with the one-line message, before it is copied into the store."""
    root = _memory_cgroup()
    if root is None:
        pytest.skip("needs root and the cgroup v1 memory controller (the budget case runs everywhere)")
    group = root / f"horizon-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(700 << 20))
        script = REPO / "tests" / "scripts" / "out_of_core_meta.py"
        cmd = f'echo $$ > {group}/cgroup.procs && exec "{sys.executable}" "{script}" too_big "{tmp_path}" {1 << 30}'
        out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=120)
        assert out.returncode not in (0, -9, 137), out.stderr[-2000:]
        line = next(x for x in out.stderr.splitlines() if "MemoryError: state_store:" in x)
        assert "built its weights in memory (1 GiB)" in line and "the memory this process may have" in line, line
        assert "configure_model" in line and "empty_init=True" in line
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                import time

                time.sleep(0.1)


def test_a_streamed_save_that_fails_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """StreamedCheckpointIO (a fit with a store saves through it) writes back as it goes and stays atomic: a save
    that dies after writing part of the file leaves the previous checkpoint whole and no temporary file."""
    from lightning_horizon.store import checkpoint as ckpt_io

    monkeypatch.setattr(ckpt_io, "WRITE_BACK", 1 << 16)
    io = ckpt_io.StreamedCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"w": torch.arange(1 << 18, dtype=torch.float32)}, path)
    before = path.read_bytes()
    written = []
    real_write = ckpt_io._WriteBack.write

    def dies(self, data):
        if sum(written) > 1 << 18:
            raise OSError("killed mid-save")
        written.append(len(memoryview(data).cast("B")))
        return real_write(self, data)

    monkeypatch.setattr(ckpt_io._WriteBack, "write", dies)
    with pytest.raises((OSError, RuntimeError)):  # torch.save reports the writer it lost as a RuntimeError
        io.save_checkpoint({"w": torch.zeros(1 << 20)}, path)
    assert sum(written) > 1 << 18  # it had written (and written back) part of the new file
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["last.ckpt"]
    assert torch.equal(io.load_checkpoint(path)["w"], torch.arange(1 << 18, dtype=torch.float32))


def test_a_model_declared_under_a_plain_meta_device_gets_each_modules_own_init(tmp_path, caplog):
    """Declared under torch.device("meta") (no record): each module's reset_parameters, in module order, replayed
    into the store from the generator state at setup, with a warning saying so; for a stack of torch modules right
    after seed_everything that is the in-RAM build, bit for bit."""

    class Stack(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(3))

        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            for b in self.blocks:
                batch = b(batch)
            return batch.square().mean()

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.ones(8, 8), batch_size=4)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(meta: bool) -> dict[str, Tensor]:
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                            strategy=HorizonStrategy(state_store=StoreConfig(path=str(tmp_path / "s"), probe_bytes=0)
                                                     if meta else None, threads_per_rank=1))
        L.seed_everything(5, verbose=False)
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = Stack()
        trainer.fit(model)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    ram = fit(False)
    with caplog.at_level("WARNING"):
        assert _same(fit(True), ram)
    assert any("declared on the meta device outside" in r.getMessage() for r in caplog.records)
