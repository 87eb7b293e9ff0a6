"""Out-of-core training (``HorizonStrategy(state_store=...)``, lightning_horizon/store/).

A store only changes where the bytes live between uses: every fit with a store must give exactly (bitwise) the
weights and losses of the same fit in RAM, step by step. The fits run through tests/scripts/composition_fit.py, in
pairs (store, RAM) over every valid pair of precision, optimization, backoff, scheduler, recompute, model and
prefetch mode (tests/pairwise.py), at 1 rank and at 2 gloo ranks; each store fit also reports that its parameters and
optimizer state really were the store's memory-mapped tensors. Checkpoints resume exactly, also after a SIGKILL
(which leaves nothing in the store's folder); a full disk or an unwritable folder fails at setup; a skipped step
leaves the store's bytes untouched; peak memory stays a layer's worth above the process, where the RAM fit holds
the whole state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_horizon import GradNormBackoff, HorizonStrategy
from lightning_horizon.optim_parts import step_in_parts
from lightning_horizon.state import TrainingState
from lightning_horizon.store import StateStore, StoreConfig, StoreSpaceError, resolve_store
from lightning_horizon.store.step import StreamedStep
from lightning_horizon.store.units import plan_units
from tests.launch import REPO, run_scripts
from tests.pairwise import all_pairs

SCRIPT = REPO / "tests" / "scripts" / "composition_fit.py"
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
    ({"state_store": "auto", "state": "node_sharded"}, ("state_store='auto'", "state='node_sharded'", "replicated")),
])
def test_refused_by_name(kwargs, names):
    with pytest.raises(ValueError) as err:
        HorizonStrategy(**kwargs)
    assert all(n in str(err.value) for n in names), str(err.value)


@pytest.mark.parametrize("kwargs, names", [
    ({"prefetch": "mmap"}, ("StoreConfig(prefetch='mmap')", "'read'", "'readahead'", "'none'")),
    ({"probe_bytes": -1}, ("StoreConfig(probe_bytes=-1)", ">= 0")),
    ({"path": 5}, ("StoreConfig(path=5)", "folder")),
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


def _stack(n: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(n)], nn.Linear(8, 2))


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1),
])
def test_layer_by_layer_step_is_the_whole_step(tmp_path, make):
    """StreamedStep steps unit by unit, state in the store, and computes exactly what one step computes; step
    hooks fire once per step, a scheduler's wrapper of ``step`` is kept and put back."""
    ref, mod = _stack(), _stack()
    state = TrainingState()
    store = StateStore(str(tmp_path), plan_units(mod), "read")
    store.install()
    state.store = store
    opt_ref, opt = make(ref.parameters()), make(mod.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)  # wraps opt.step (an instance attribute)
    wrapped = opt.__dict__["step"]
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    streamed = StreamedStep(opt, store, state)
    x = torch.randn(16, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for m, o in ((ref, opt_ref), (mod, opt)):
                o.zero_grad()
                m(x).square().mean().backward()
                o.step()
            sched.step()
            opt_ref.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
    assert calls == ["pre", "post"] * 3 and not caught  # no "step() overridden after the scheduler" warning
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


def test_full_disk_fails_at_setup(tmp_path):
    """A 1 MiB tmpfs cannot take the store: setup fails naming the folder and the bytes, before any step, and
    leaves nothing in the folder (as root: mount needs it)."""
    folder = tmp_path / "small"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
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
    finally:
        subprocess.run(["umount", str(folder)], check=False)


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
# 2 gloo ranks (DDP averages the gradients the store holds): plain, and the busiest combination
WORLD2 = {"w2-gpt": {**dict(zip(DIMENSIONS, (PRECISION["32-true"], "automatic", False, False, None, "gpt", "read")))},
          "w2-busy": {**dict(zip(DIMENSIONS, ("bf16-true+kahan", "accumulate", True, True, "forced", "tied",
                                             "readahead")))}}


def run(name: str, case: dict, world: int, store: Any, work: Path, **extra: Any) -> dict:
    precision = case["precision"]
    strategy = {}
    if store:
        strategy["state_store"] = {"path": str(work / "stores" / name), "prefetch": case["prefetch"], "probe_bytes": 0}
    return {"name": f"{name}-{'store' if store else 'ram'}", "model": case["model"],
            "optimization": case["optimization"], "world": world, "ranks_per_node": world,
            "precision": PRECISION.get(precision, precision), "strategy": strategy, "sharding": case["sharding"],
            "backoff": case["backoff"], "scheduler": case["scheduler"], "steps": STEPS, "epoch_steps": SAVE_AT,
            **extra}


CKPT = {**dict(zip(DIMENSIONS, ("bf16-true+fp32", "automatic", False, False, None, "gpt", "read")))}


def launch(work: Path, label: str, runs: list[dict], world: int, expect_rc: int = 0) -> str:
    cfg = work / f"{label}.json"
    cfg.write_text(json.dumps({"runs": runs}))
    out = run_scripts([(SCRIPT, [cfg, work], None)], timeout=600, check=False)[0]
    assert out.returncode == expect_rc, out.stdout[-6000:]
    return out.stdout


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("out_of_core")
    (work / "stores").mkdir()
    runs = [run(name, case, 1, store, work) for name, case in CASES.items() for store in (True, False)]
    # a checkpoint at step 2 (bf16-true + fp32 masters: masters and optimizer state in the store), resumed
    runs.append(run("ckpt", CKPT, 1, True, work, save_at=SAVE_AT))
    runs.append(run("ckpt", CKPT, 1, False, work, save_at=SAVE_AT))
    launch(work, "w1", runs, 1)
    ckpt = work / "ckpt-store.ckpt" / f"step={SAVE_AT}.ckpt"
    # a crash: SIGKILL at step 3, after the checkpoint of step 2; then resume from it
    killed = run("killed", CKPT, 1, True, work, save_at=SAVE_AT, kill_at=SAVE_AT + 1)
    stdout = launch(work, "kill", [killed], 1, expect_rc=-9)
    assert f"KILLED at step {SAVE_AT + 1}" in stdout
    resumed = [run("resume", CKPT, 1, True, work, resume_from=str(ckpt)),
               run("resume-killed", CKPT, 1, True, work,
                   resume_from=str(work / "killed-store.ckpt" / f"step={SAVE_AT}.ckpt"))]
    launch(work, "resume", resumed, 1)
    w2 = [run(name, case, 2, store, work) for name, case in WORLD2.items() for store in (True, False)]
    launch(work, "w2", w2, 2)
    loaded: dict[str, Any] = {"_work": work}
    for r in runs + resumed + w2:
        loaded[r["name"]] = [torch.load(work / f"{r['name']}.rank{k}.pt", weights_only=False)
                             for k in range(r["world"])]
        for res in loaded[r["name"]]:
            assert res["error"] is None, f"{r['name']}: {res['error']}\n{res.get('traceback', '')}"
            assert not res["violations"], res["violations"]
    return loaded


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check_pair(store: list[dict], ram: list[dict], case: dict) -> None:
    for s, r in zip(store, ram):
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
    check_pair(results[f"{name}-store"], results[f"{name}-ram"], WORLD2[name])


def test_resume_exact_also_after_a_kill(results):
    whole, ram = results["ckpt-store"][0], results["ckpt-ram"][0]
    assert same(whole["final"], ram["final"])
    assert "master" in whole["store_kinds"]
    for name in ("resume-store", "resume-killed-store"):
        resumed = results[name][0]
        assert resumed["global_step"] == whole["global_step"]
        assert same(resumed["final"], whole["final"]), name  # bitwise
        assert resumed["losses"] == whole["losses"][SAVE_AT:], name
    assert os.listdir(results["_work"] / "stores" / "killed") == []  # the killed run left no file behind


# ---------------------------------------------------------------------------------------------- memory


def test_peak_memory_is_a_layer_not_the_state(tmp_path):
    """A GPT whose gradients and AdamW state take 76 MB: in RAM the peak grows by that (and the activations, code
    pages) during training; with the store by a few layers' worth less than that: what streaming saves is most of
    the state (fresh processes, peak RSS = VmHWM, file-backed pages included; glibc's mmap threshold fixed in both,
    so that freed buffers leave the process)."""
    figures = {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    for arm in ("ram", "store"):
        out = subprocess.run([sys.executable, str(MEMORY), arm, str(tmp_path / arm)], capture_output=True, text=True,
                             timeout=300, cwd=REPO, env=env)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        figures[arm] = json.loads(out.stdout.strip().splitlines()[-1])
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
                                                 sharding=ShardingConfig(budget=1 << 40, adaptive=False)))
    sys.path.insert(0, str(REPO))
    from tests.scripts.composition_models import BATCH, dataset

    trainer.fit(build("gpt", "automatic"), torch.utils.data.DataLoader(dataset("gpt", 64), batch_size=BATCH))
    first = next(p for p in pinned if p)
    assert pinned[0] == [] and first == [1]  # after a measured step, not before; the last unit (of 2) first
    assert [0, 1] in pinned[:9]  # then the one before it
    assert pinned[-1] == []  # squeezed: given back
    assert trainer.strategy.store is None  # the part is gone after fit
