"""The parts contract and its registry: hooks in order, saved state handed to a part whenever it appears."""

from pathlib import Path

import lightning.pytorch as L
import pytest
import torch

from lightning_horizon import HorizonStrategy
from lightning_horizon.parts import GRADIENTS, PARAMETERS, Part, Parts
from lightning_horizon.store import StoreConfig


class Recorder(Part):
    def __init__(self, name, calls):
        self.name, self.calls, self.loaded = name, calls, None

    def after_setup(self):
        self.calls.append((self.name, "after_setup"))

    def after_optimizer_step(self):
        self.calls.append((self.name, "after_optimizer_step"))

    def before_save(self, model):
        self.calls.append((self.name, "before_save", model))

    def teardown(self):
        self.calls.append((self.name, "teardown"))

    def state_dict(self):
        return {"of": self.name}

    def load_state_dict(self, state):
        self.loaded = state


def test_hooks_run_on_every_part_in_order_and_state_round_trips():
    calls, parts = [], Parts()
    a, b = parts.add("a", Recorder("a", calls)), parts.add("b", Recorder("b", calls))
    parts.after_setup()
    parts.after_optimizer_step()
    parts.before_save("ddp")
    parts.teardown()
    assert calls == [("a", "after_setup"), ("b", "after_setup"), ("a", "after_optimizer_step"),
                     ("b", "after_optimizer_step"), ("a", "before_save", "ddp"), ("b", "before_save", "ddp"),
                     ("a", "teardown"), ("b", "teardown")]
    assert parts.state_dicts() == {"a": {"of": "a"}, "b": {"of": "b"}}
    assert parts.get("a") is a and "b" in parts and parts.get("c") is None


def test_a_part_that_runs_before_another_stays_ahead_of_it_whichever_is_added_first():
    # the store reads the sharder's measured peak in its step hook, before the sharder measures the next step: ahead
    # of it when the store is added first (a first fit) and when the sharder is (it stays for a second fit)
    from lightning_horizon.store.part import OutOfCore

    assert "sharding" in OutOfCore.runs_before

    class Ahead(Recorder):
        runs_before = ("sharding",)

    calls, parts = [], Parts()
    for name in ("rng", "sharding", "collectives"):
        parts.add(name, Recorder(name, calls))
    parts.add("store", Ahead("store", calls))
    parts.after_optimizer_step()
    assert [c[0] for c in calls] == ["rng", "store", "sharding", "collectives"]
    parts.remove("store")
    parts.add("store", Ahead("store", calls))
    replaced = parts.add("rng", Recorder("rng", calls))  # a part replaced keeps its place
    assert [p.name for p in parts] == ["rng", "store", "sharding", "collectives"]
    assert parts.get("rng") is replaced


def test_saved_state_waits_for_the_part_that_takes_it():
    parts, calls = Parts(), []
    early = parts.add("early", Recorder("early", calls))
    parts.load_state_dicts({"early": {"x": 1}, "late": {"x": 2}, "never": {"x": 3}})
    assert early.loaded == {"x": 1}  # restored at once
    late = parts.add("late", Recorder("late", calls))
    assert late.loaded == {"x": 2}  # restored when created (setup creates the sharder after the load)
    parts.after_setup()
    assert parts.add("never", Recorder("never", calls)).loaded is None  # not kept past setup


def test_a_part_implements_the_contract():
    class Incomplete:
        def state_dict(self):
            return {}

    missing = ("label, takes, layout_free, runs_before, refuses, connect, after_setup, before_training_step,"
               " after_training_step, pre_backward, post_backward, clip_gradients, gradients_ready, optimizer_stepped, after_optimizer_step,"
               " before_save, comm_metrics, load_state_dict, teardown")
    with pytest.raises(TypeError, match=rf"part 'x'=Incomplete: .*missing {missing} .*lightning_horizon.parts.Part"):
        Parts().add("x", Incomplete())


class Taker(Part):
    """A user's part that keeps the weights somewhere of its own, and cannot step Adagrad."""

    label = "MyOffload(...)"
    takes = {PARAMETERS: "pinned in a memory pool of mine"}

    def __init__(self):
        self.connected = False

    def refuses(self, optimizer):
        return "it keeps no per-parameter sum" if isinstance(optimizer, torch.optim.Adagrad) else None

    def connect(self, trainer, module, optimizers):
        self.connected = True


def test_the_registry_refuses_what_two_parts_declare_naming_both():
    """Parts.check at setup: two parts that take one thing, or an optimizer a part refuses (torch's, unwrapped)."""
    params = [torch.nn.Parameter(torch.zeros(2))]
    parts = Parts()
    parts.add("mine", Taker())
    parts.add("sync", type("Sync", (Part,), {"takes": {GRADIENTS: "a hook"}})())  # no label: named by its key
    parts.check([torch.optim.SGD(params, lr=0.1)])  # nothing in the way
    with pytest.raises(ValueError, match=r"^MyOffload\(\.\.\.\) cannot step Adagrad: it keeps no per-parameter sum$"):
        parts.check([torch.optim.SGD(params, lr=0.1), torch.optim.Adagrad(params)])
    other = parts.add("other", type("Other", (Part,), {"takes": {PARAMETERS: "in files"}})())
    with pytest.raises(ValueError, match=r"^MyOffload\(\.\.\.\) with other: both take the parameters' storage"
                                         r" \(MyOffload\(\.\.\.\): pinned in a memory pool of mine; other: in files\)"):
        parts.check([])
    assert other.label == "" and parts.get("sync").takes == {GRADIENTS: "a hook"}
    # before a part installs itself: the same refusal, the part not added
    parts.remove("other")
    late = type("Late", (Part,), {"label": "Late(...)", "takes": {PARAMETERS: "mapped"}})()
    with pytest.raises(ValueError, match=r"^MyOffload\(\.\.\.\) with Late\(\.\.\.\): both take the parameters'"):
        parts.refuse_taken("late", late)
    assert "late" not in parts


def test_a_users_part_that_takes_what_the_store_takes_is_refused_at_setup(tmp_path: Path):
    """A real fit: the user's part and the out-of-core store both keep the weights; setup refuses the pair before any
    part connects or a step runs, and the store's folder is gone again (teardown ran)."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    strategy, mine = HorizonStrategy(state_store=StoreConfig(path=str(tmp_path / "s"), probe_bytes=0)), Taker()
    strategy.parts.add("mine", mine)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    with pytest.raises(ValueError) as err:
        trainer.fit(BoringModel())
    assert str(err.value).startswith("MyOffload(...) with HorizonStrategy(state_store=...): both take the parameters'"
                                     " storage"), str(err.value)
    assert not mine.connected and trainer.global_step == 0
    assert not any((tmp_path / "s").rglob("*"))


class Clipper(Part):
    """Records every clip it is asked for; clips by value itself (to a mark it can see) when ``takes_value``."""

    def __init__(self, takes_value):
        self.takes_value, self.asked = takes_value, []

    def clip_gradients(self, plugin, optimizer, clip_val, algorithm):
        self.asked.append((clip_val, algorithm.value))
        if self.takes_value and algorithm == "value":
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad.fill_(-7.0)  # not what torch's clip_grad_value_ would leave
            return True
        return False


def test_every_clipping_path_passes_the_parts_and_the_plugins_own_clip_runs_where_none_clips(tmp_path: Path):
    """Trainer(gradient_clip_val=...) and the module's own self.clip_gradients (in manual optimization) reach the
    parts' clip_gradients; a part that clips replaces the plugin's clip, one that does not leaves torch's
    clip_grad_norm_'s gradients; after fit the plugin's method is its class's again."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    seen = {}

    class Manual(BoringModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self.loss(self(batch)))
            expected = [p.grad.clone() for p in self.parameters()]
            reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in expected]
            for r, g in zip(reference, expected):
                r.grad = g
            torch.nn.utils.clip_grad_norm_(reference, 0.01)  # what the plugin's own clip must leave
            self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
            seen["norm"] = all(torch.equal(p.grad, r.grad) for p, r in zip(self.parameters(), reference))
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="value")
            seen["value"] = all(bool((p.grad == -7.0).all()) for p in self.parameters())
            opt.step()

    def fit(model, part, **kwargs):
        strategy = HorizonStrategy()
        strategy.parts.add("clip", part)
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=str(tmp_path), **kwargs)
        trainer.fit(model)
        assert "clip_gradients" not in trainer.precision_plugin.__dict__  # the class's own again
        return part

    assert fit(Manual(), Clipper(takes_value=True)).asked == [(0.01, "norm"), (0.5, "value")]
    assert seen == {"norm": True, "value": True}
    assert fit(BoringModel(), Clipper(False), gradient_clip_val=0.25).asked == [(0.25, "norm")]


def test_strategy_accessors_before_setup():
    strategy = HorizonStrategy()
    assert strategy.sharder is None and strategy.gradient_sync is None and strategy.comm_metrics() == {}
    assert not strategy.nodes_diverge and "rng" in strategy.parts
