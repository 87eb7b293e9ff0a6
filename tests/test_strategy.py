"""HorizonStrategy: parity with Lightning's DDP, pinning, comm hooks on CPU, bad input.

The multi-process tests are real gloo runs of tests/scripts/fit.py under Lightning's own launcher, grouped so
that one launch covers several fits (process start and `import lightning` cost seconds per rank). Nodes launched
by NODE_RANK, their process groups and the placement table: test_topology.py.
"""

import ast
import dataclasses
import inspect
import textwrap

import lightning as L
import pytest
import torch

from lightning_horizon import HorizonStrategy, cpu
from lightning_horizon.options import GROUPS, WHOLE, HorizonOptions, keywords
from tests.scripts.fit import TinyLM, data, launch


# ------------------------------------------------------------------ one process, in this process


def _fit_one(strategy, steps=6):
    L.seed_everything(7, verbose=False)
    model = TinyLM()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(data(), batch_size=16))
    return model, trainer


def test_one_process_matches_lightning_ddp_with_a_world_size_1_group_and_no_ddp_wrapper():
    theirs, _ = _fit_one("ddp")
    torch.distributed.destroy_process_group()  # Lightning's ddp with one device starts one
    ours, trainer = _fit_one("horizon")
    assert isinstance(trainer.strategy, HorizonStrategy)
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1  # as ddp: user code works
    assert trainer.strategy.model is ours  # no DDP wrapper around a single process
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses), rtol=1e-6, atol=0)
    assert ours.losses[-1] < ours.losses[0]
    # reductions over one rank give the value itself, as Lightning's single-device strategy (no all-reduce over the
    # world-size-1 group: ~0.2 ms a call); several ranks reduce as DDP (test_two_processes_match... below)
    t = torch.tensor([3, 4])
    assert trainer.strategy.reduce(t) is t and trainer.strategy.reduce(t, reduce_op="sum") is t
    assert trainer.strategy.reduce_boolean_decision(True) is True


def test_registered_names():
    for name, method in (("horizon", "popen"), ("horizon_spawn", "spawn"), ("horizon_fork", "fork")):
        for suffix, unused in (("", False), ("_find_unused_parameters_true", True)):  # as "ddp..." names
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy=name + suffix, logger=False)
            assert isinstance(trainer.strategy, HorizonStrategy)
            assert trainer.strategy._start_method == method
            assert trainer.strategy._ddp_kwargs.get("find_unused_parameters", False) is unused
    import importlib

    import lightning_horizon

    importlib.reload(lightning_horizon)  # registration is idempotent


def test_every_strategy_keyword_is_a_field_of_exactly_one_config_with_its_default():
    params = inspect.signature(HorizonStrategy.__init__).parameters
    own = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert sorted(own) == sorted(keywords()) and len(set(keywords())) == len(keywords())
    # every group's field is the keyword of the same name, with the same default; a whole config is a field of
    # HorizonOptions of the keyword's name, off by default
    for group in GROUPS:
        for f in dataclasses.fields(group):
            if f.metadata.get("keyword", True):
                assert params[f.name].default == f.default, (group.__name__, f.name)
            else:
                assert f.name not in params, (group.__name__, f.name)
    whole = {f.name: f.default for f in dataclasses.fields(HorizonOptions)}
    assert all(params[n].default is None and whole[n] is None for n in keywords() if n not in
               {f.name for g in GROUPS for f in dataclasses.fields(g)})
    # handed over by field name: each config built in the constructor from exactly its keywords, each as given
    calls = {node.func.id: {k.arg: k.value.id for k in node.keywords if isinstance(k.value, ast.Name)}
             for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(HorizonStrategy.__init__))))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    for group in GROUPS:
        own = {f.name for f in dataclasses.fields(group) if f.metadata.get("keyword", True)}
        assert calls[group.__name__] == {n: n for n in own}, group.__name__
    assert {n: calls["HorizonOptions"][n] for n in WHOLE} == {n: n for n in WHOLE}
    given = {"ranks_per_node": 2, "compression": "bf16", "collectives": "hierarchical", "heartbeat_timeout": 5.0,
             "threads_per_rank": 1, "sync_overlap": False}
    options = HorizonStrategy(**given).options
    held = {f.name: getattr(getattr(options, name), f.name) for name, group in
            (("process", GROUPS[0]), ("collectives", GROUPS[1]), ("node_state", GROUPS[2]))
            for f in dataclasses.fields(group)}
    assert {k: held[k] for k in given} == given


@pytest.mark.parametrize(
    ("kwargs", "devices", "needle"),
    [
        ({"process_group_backend": "nccl2"}, 1, "process_group_backend='nccl2'"),
        ({"ranks_per_node": 3}, 2, "ranks_per_node=3"),
        ({"ranks_per_node": 0}, 1, "ranks_per_node=0"),
        ({"bucket_size_mb": 0}, 1, "bucket_size_mb=0"),
        ({"bucket_size_mb": -4}, 1, "bucket_size_mb=-4"),
        ({"timeout": 0}, 1, "timeout=0"),
        ({"timeout": -1.5}, 1, "timeout=-1.5"),
        ({"threads_per_rank": 0}, 1, "threads_per_rank=0"),
        ({"heartbeat_timeout": 0}, 1, "heartbeat_timeout=0"),
        ({"heartbeat_timeout": "30"}, 1, "heartbeat_timeout='30'"),
    ],
)
def test_bad_input_fails_before_any_process_group(kwargs, devices, needle):
    with pytest.raises(ValueError, match="allowed|must") as err:
        L.Trainer(accelerator="cpu", devices=devices, strategy=HorizonStrategy(**kwargs), logger=False)
    assert needle in str(err.value)
    assert not torch.distributed.is_initialized()


# ------------------------------------------------------------------ real multi-process runs


def test_two_processes_match_lightning_ddp_in_every_variant(tmp_path):
    runs = [
        {"name": "ddp", "strategy": "ddp", "devices": 2},
        {"name": "horizon", "strategy": "horizon", "devices": 2},
        {"name": "hook", "strategy": "horizon", "devices": 2, "max_steps": 2,
         "strategy_kwargs": {"allreduce_hook": True, "ranks_per_node": 1}},
        {"name": "manual_ddp", "strategy": "ddp", "devices": 2, "manual": True, "two_optimizers": True, "max_steps": 6},
        {"name": "manual", "strategy": "horizon", "devices": 2, "manual": True, "two_optimizers": True, "max_steps": 6},
        {"name": "accum_ddp", "strategy": "ddp", "devices": 2, "accumulate": 2, "scheduler": "cosine", "max_steps": 4},
        {"name": "accum", "strategy": "horizon", "devices": 2, "accumulate": 2, "scheduler": "cosine", "max_steps": 4,
         "evaluate": True, "validate_during_fit": True},
    ]
    res = launch(tmp_path, runs)
    for ours, theirs in (("horizon", "ddp"), ("manual", "manual_ddp"), ("accum", "accum_ddp")):
        for rank in (0, 1):
            a, b = res[ours][rank], res[theirs][rank]
            assert len(a["losses"]) == len(b["losses"]) > 0
            torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-6, atol=0)
            assert a["lrs"] == pytest.approx(b["lrs"])
            assert a["param_sum"] == pytest.approx(b["param_sum"], rel=1e-6)
        assert res[ours][0]["param_sum"] == res[ours][1]["param_sum"]  # replicas stay identical
    assert res["horizon"][0]["losses"][-1] < res["horizon"][0]["losses"][0]
    assert res["accum"][0]["global_step"] == 4 and len(res["accum"][0]["losses"]) == 8  # 2 micro-batches a step
    assert "val_loss" in res["accum"][0]["validate"][0] and res["accum"][0]["predict_batches"] > 0

    # A comm hook passed on CPU is really registered (Lightning alone drops it on CPU).
    assert "allreduce_hook" in res["hook"][0]["comm_hook"]
    assert "flat" in res["horizon"][0]["comm_hook"]  # the default: our flat allreduce (with its accounting)
    # ranks_per_node=1: two emulated nodes of one rank each.
    assert res["hook"][1]["intra_ranks"] == [1] and res["hook"][1]["inter_ranks"] == [0, 1]
    # The default placement: one core each, disjoint, threads sized to the cores.
    placement = res["horizon"][0]["placement"]
    cores = [set(r["cores"]) for r in placement]
    assert cores[0].isdisjoint(cores[1]) and not any(r["shared"] for r in placement)
    assert all(res["horizon"][r]["threads"] == len(cores[r]) for r in (0, 1))
    # every rank's malloc keeps freed memory (glibc's, with thresholds the environment leaves alone), rank 0 says so
    if cpu.allocator() is None and cpu._glibc_malloc() is not None:
        assert all(r["keeps_freed_memory"] for r in placement)
        assert "allocator glibc malloc, keeps freed memory" in res["horizon"][0]["table"]
    assert res["horizon"][0]["backend"] == "gloo"
