"""HorizonStrategy as a drop-in for Lightning's ddp (issue 17): what code written for "ddp" sees must not change.

Every 2-rank check but the spawn variant shares one launch (``launched``: tests/launch.run_worlds, one process start;
each check's world of 2 ranks forked from it after its imports, one world after another, with the variables
Lightning's launcher gives its ranks): the checkpoints and loaders of tests/scripts/dropin_fit.py (ddp and horizon
side by side, several fits), the thread settings after fit and each unused-parameter case of
tests/scripts/dropin_lifecycle.py (an error ends only its own world). The spawn variant of the DataLoader check stays
a launch of its own, a real spawn (what it tests), and slow.
"""

import collections
import io
import json
import os
import pickle

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_horizon import HorizonStrategy, cpu, wire
from tests.launch import REPO, assert_exited, run_script, run_worlds
from tests.scripts.dropin_lifecycle import UnusedParameter, settings

SCRIPTS = REPO / "tests" / "scripts"


#: HorizonStrategy kwargs of the unused-parameter launches, by test id
UNUSED = {
    "flat": {},
    "hierarchical-int8": {"collectives": "hierarchical", "ranks_per_node": 1, "compression": "int8"},
    # the same reducer error under every comm hook: two in CI, the other two with the slow tests (CI's time)
    "local-sgd": {"collectives": "hierarchical", "ranks_per_node": 1, "sync_every": 2},
    "torus2d": {"collectives": "torus2d", "torus_shape": [1, 2]},
}
SLOW_UNUSED = ("local-sgd", "torus2d")
UNUSED_ALLOWED = {"collectives": "hierarchical", "ranks_per_node": 1, "compression": "int8",
                  "find_unused_parameters": True}


def _selected_unused(request) -> list[str]:
    """The unused-parameter cases pytest will run (``-m slow`` adds two): only those are launched."""
    return [item.callspec.id for item in request.session.items
            if item.module is request.module and item.originalname == "test_two_ranks_unused_parameters_raise"
            "_lightnings_explanation"]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """``(work, {tag: how the job ended})``: every 2-rank job of this module in one launch."""
    work = tmp_path_factory.mktemp("dropin")

    def two(tag: str, call: str, *args, **env) -> dict:
        return {"tag": tag, "devices": 2, "call": call, "args": [*map(str, args)], "env": env}

    lifecycle = "tests.scripts.dropin_lifecycle:main"
    jobs = [two("fit", "tests.scripts.dropin_fit:main", work / "out", OMP_NUM_THREADS=1),
            # OMP_NUM_THREADS unset (as in the user's process): Lightning's launcher sets it, teardown takes it back
            two("threads", lifecycle, "threads", work / "threads.json"),
            two("unused-allowed", lifecycle, "unused", work / "unused-allowed.json", json.dumps(UNUSED_ALLOWED))]
    jobs += [two(f"unused-{case}", lifecycle, "unused", work / f"unused-{case}.json", json.dumps(UNUSED[case]))
             for case in _selected_unused(request)]
    ended, _ = run_worlds(jobs, work, timeout=240 + 120 * (len(jobs) - 1))
    return work, ended


@pytest.fixture(scope="module")
def dropin_fit(launched):
    """``{rank: what that rank recorded}`` from dropin_fit.py's world."""
    work, ended = launched
    assert_exited(ended, "fit", [0, 0])
    return {r: json.loads((work / f"out.rank{r}.json").read_text()) for r in (0, 1)}


# ------------------------------------------------------------------ item 4: torch.save on rank 0 only


def test_checkpoints_call_torch_save_on_rank_zero_only_as_ddp_does(dropin_fit):
    saves = {rank: dropin_fit[rank]["saves"] for rank in (0, 1)}
    for name in saves[0]:
        theirs = "ddp_resumed" if name.endswith("_resumed") else "ddp"
        assert saves[1][name]["calls"] == [], name  # rank 1 never serializes, not even the state it sends
        assert len(saves[0][name]["calls"]) == len(saves[0][theirs]["calls"]) == 2, name  # one per checkpoint
    for name in ("horizon", "horizon_int8", "horizon_local_sgd", "horizon_local_sgd_resumed"):
        # what each rank sent is exactly what the file holds for it (dtype, shape, stride, bytes)
        assert saves[0][name]["file"] == [saves[0][name]["sent"], saves[1][name]["sent"]], name
    assert saves[0]["horizon_int8"]["file"][1]["collectives"]["error_feedback"]["residual"]  # residual tensors
    assert set(saves[0]["horizon_local_sgd"]["file"][1]["node"]) == {"state_dict", "optimizer_states"}


def _tensors():
    base = torch.randn(4, 5)
    return {
        "bf16": torch.randn(3, 2).bfloat16(), "f16": torch.randn(2).half(), "int64": torch.arange(-3, 7),
        "bool": torch.tensor([True, False, True]), "zero_dim": torch.tensor(3.5), "empty": torch.empty(0, 3),
        "transposed": base.t(), "view": base[1:, 2:], "base": base, "complex": torch.randn(2, dtype=torch.complex64),
        "generator_state": torch.Generator().manual_seed(3).get_state(), "grad": torch.ones(2, requires_grad=True),
        "parameter": nn.Parameter(torch.ones(3)), "frozen": nn.Parameter(torch.ones(1), requires_grad=False),
    }


Point = collections.namedtuple("Point", "x y")


def _tree():
    t = _tensors()
    tree = {"tensors": t, "ordered": collections.OrderedDict(b=t["int64"], a=[1, "x", None]),
            "nested": [Point(t["bool"], (t["empty"], 2.5)), {"deep": [[t["zero_dim"]]]}], "plain": {"n": 3},
            "same": t["bf16"], "size": torch.Size([2, 3])}
    return tree


def _through_pickle(obj):
    """What an object collective delivers: pickled on one rank, unpickled on the other."""
    return pickle.loads(pickle.dumps(obj))


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_wire_round_trip_is_bit_exact_and_never_calls_torch_save(monkeypatch):
    tree = _tree()
    calls = []
    save = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: calls.append(1) or save(*a, **k))
    sent = pickle.dumps(wire.pack(tree))
    assert calls == []  # a tensor pickled as it is goes through torch.save: these do not
    monkeypatch.undo()
    back = wire.unpack(pickle.loads(sent))

    # The checkpoint rank 0 writes is byte for byte the one the pickled tensors gave (values, dtypes, shapes,
    # strides, storages, Parameters, requires_grad, container types, objects met twice).
    assert _saved(back) == _saved(_through_pickle(tree))
    for name, t in tree["tensors"].items():
        got = back["tensors"][name]
        assert type(got) is type(t) and got.dtype == t.dtype and got.shape == t.shape, name
        assert got.stride() == t.stride() and got.requires_grad == t.requires_grad, name
        assert torch.equal(got.detach().reshape(-1).view(torch.uint8), t.detach().reshape(-1).view(torch.uint8)), name
    assert type(back["ordered"]) is collections.OrderedDict and list(back["ordered"]) == ["b", "a"]
    assert type(back["nested"][0]) is Point and back["nested"][0].y[1] == 2.5
    assert back["same"] is back["tensors"]["bf16"]  # one object sent twice stays one object
    # as after pickle, a view comes with its whole storage, a copy of its own; nothing aliases the sender's memory
    view, base = back["tensors"]["view"], back["tensors"]["base"]
    assert view.untyped_storage().nbytes() == base.untyped_storage().nbytes() == 4 * 20
    assert view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert base.untyped_storage().data_ptr() != tree["tensors"]["base"].untyped_storage().data_ptr()


def test_wire_leaves_objects_without_tensors_and_unusual_tensors_to_pickle():
    plain = {"a": [1, (2, "x")], "b": None}
    assert wire.pack(plain) is plain and wire.unpack(plain) is plain
    sparse, tagged = torch.eye(3).to_sparse(), torch.ones(2)
    tagged.note = "kept by pickle"
    packed = wire.pack({"sparse": sparse, "tagged": tagged, "dense": torch.ones(1)})
    assert packed["sparse"] is sparse and packed["tagged"] is tagged and isinstance(packed["dense"], wire.Record)
    assert torch.equal(wire.unpack(_through_pickle(packed))["sparse"].to_dense(), torch.eye(3))


# ------------------------------------------------------------------ item 5: DataLoader subclasses


def test_dataloader_subclass_reinstantiation_matches_ddp(dropin_fit):
    # Lightning re-instantiates the loader to inject a DistributedSampler; HorizonStrategy leaves that to it
    # (DDPStrategy's distributed_sampler_kwargs), so each outcome, success or error, is ddp's.
    loaders = dropin_fit[0]["loaders"]
    sources = sorted({key.split("/")[1] for key in loaders})
    assert len(sources) == 4
    for source in sources:
        assert loaders[f"horizon/{source}"] == loaders[f"ddp/{source}"], source
    assert loaders["horizon/kwargs-fit"] == "ok"
    assert "got multiple values for argument 'sampler'" in loaders["horizon/kwargs-hook"]  # the error
    assert "doesn't expose all its attributes" in loaders["horizon/positional-hook"]


@pytest.mark.slow
def test_dataloader_subclass_reinstantiation_matches_ddp_spawn(tmp_path):
    out = tmp_path / "spawn.json"
    run_script(SCRIPTS / "dropin_loader.py", [out, "ddp_spawn,horizon_spawn", "positional-hook,kwargs-hook"],
               timeout=240, env={"OMP_NUM_THREADS": "1"})
    loaders = json.loads(out.read_text())
    for source in ("positional-hook", "kwargs-hook"):
        assert loaders[f"horizon_spawn/{source}"] == loaders[f"ddp_spawn/{source}"] != "ok", source

def _trainer(strategy, **kwargs):
    return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


# ------------------------------------------------------------------ item 1: the environment after fit


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to see pinning change the affinity")
def test_fit_gives_back_threads_affinity_and_openmp_variables(monkeypatch):
    for var in ("OMP_NUM_THREADS", "KMP_AFFINITY", "KMP_BLOCKTIME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "7")
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(affinity)})  # pinning takes the cores the process started with: all of them
    torch.set_num_threads(1)
    seen = {}

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.update(settings())

    try:
        before = settings()
        _trainer(HorizonStrategy(), callbacks=[Record()]).fit(BoringModel())
        after = settings()
    finally:
        os.sched_setaffinity(0, affinity)
    assert seen["threads"] == len(affinity) and seen["env"]["OMP_NUM_THREADS"] == str(len(affinity))  # it pinned
    assert seen["affinity"] == sorted(affinity)
    assert after == before


def test_no_set_num_threads_call_where_the_count_stays_the_same(monkeypatch):
    """``torch.set_num_threads`` costs even where it changes nothing (cpu.set_threads): a fit on every core of a
    process that runs that many threads already never calls it, neither our pinning and teardown nor Lightning's
    launcher (which calls it unless ``OMP_NUM_THREADS`` is set: the strategy sets it for the launcher, as plain
    ``"ddp"`` shows); where the count changes, it is called."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(cpu.available_cores())
    torch.set_num_threads(cores)
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n))[1])
    _trainer(HorizonStrategy()).fit(BoringModel())
    assert calls == [] and torch.get_num_threads() == cores and "OMP_NUM_THREADS" not in os.environ
    _trainer("ddp").fit(BoringModel())
    torch.distributed.destroy_process_group()
    assert calls == [cores]  # Lightning's launcher: the same count, set again
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # Lightning leaves it set
    calls.clear()
    cpu.set_threads(cores)
    assert calls == []
    if cores > 1:
        cpu.set_threads(1)
        assert calls == [1] and torch.get_num_threads() == 1
        cpu.set_threads(cores)


def test_two_ranks_rank_0_gets_its_settings_back(launched):
    work, ended = launched
    assert_exited(ended, "threads", [0, 0])
    r = json.loads((work / "threads.json").read_text())
    assert r["during"]["threads"] == 1 and len(r["during"]["affinity"]) == 1  # rank 0 had one core of two
    assert r["after"] == r["before"]


# ------------------------------------------------------------------ item 2: one process has a world-size-1 group


def _predict_with_own_sampler(strategy):
    class OwnSampler(BoringModel):
        def predict_dataloader(self):  # as existing DDP projects write it
            data = RandomDataset(32, 8)
            return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))

    L.seed_everything(3, verbose=False)
    trainer = _trainer(strategy, use_distributed_sampler=False)
    return torch.cat(trainer.predict(OwnSampler()))


def test_one_process_user_code_finds_a_process_group_as_under_ddp():
    theirs = _predict_with_own_sampler("ddp")
    torch.distributed.destroy_process_group()
    ours = _predict_with_own_sampler("horizon")
    assert torch.distributed.get_world_size() == 1 and torch.distributed.get_backend() == "gloo"
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


# ------------------------------------------------------------------ item 3: unused parameters


def test_one_process_warns_about_unused_parameters_and_trains():
    model = UnusedParameter()
    unused, used = model.unused.weight.detach().clone(), model.layer.weight.detach().clone()
    with pytest.warns(UserWarning, match=r"2 parameter\(s\) got no gradient in the first step \(unused.weight,"):
        _trainer("horizon").fit(model)
    assert torch.equal(model.unused.weight, unused) and not torch.equal(model.layer.weight, used)


def test_one_process_no_warning_when_unused_parameters_are_allowed(recwarn):
    _trainer(HorizonStrategy(find_unused_parameters=True)).fit(UnusedParameter())
    assert not [w for w in recwarn if "got no gradient" in str(w.message)]


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_UNUSED else c for c in UNUSED])
def test_two_ranks_unused_parameters_raise_lightnings_explanation(launched, case):
    work, ended = launched
    assert f"unused-{case}" in ended, f"job unused-{case} never ended"  # how its ranks exit after the error: free
    error = json.loads((work / f"unused-{case}.json").read_text())["error"]
    assert error.startswith("It looks like your LightningModule has parameters that were not used")
    assert "HorizonStrategy(find_unused_parameters=True)" in error and "'horizon_find_unused_parameters_true'" in error


def test_two_ranks_unused_parameters_allowed_trains(launched):
    work, ended = launched
    assert_exited(ended, "unused-allowed", [0, 0])
    assert "error" not in json.loads((work / "unused-allowed.json").read_text())
