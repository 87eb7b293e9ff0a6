"""The parts contract and its registry: hooks in order, saved state handed to a part whenever it appears."""

import pytest

from lightning_horizon import HorizonStrategy
from lightning_horizon.parts import Part, Parts


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

    missing = ("connect, after_setup, before_training_step, after_training_step, pre_backward, post_backward,"
               " gradients_ready, optimizer_stepped, after_optimizer_step, before_save, comm_metrics, load_state_dict, teardown")
    with pytest.raises(TypeError, match=rf"part 'x'=Incomplete: .*missing {missing} .*lightning_horizon.parts.Part"):
        Parts().add("x", Incomplete())


def test_strategy_accessors_before_setup():
    strategy = HorizonStrategy()
    assert strategy.sharder is None and strategy.gradient_sync is None and strategy.comm_metrics() == {}
    assert not strategy.nodes_diverge and "rng" in strategy.parts
