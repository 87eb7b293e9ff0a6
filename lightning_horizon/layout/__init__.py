"""Layouts: how many ranks x threads per rank a node runs. The rule from the machine and the model (rule.py), the
tuned layouts cached on disk (cache.py), the tuner that measures candidates (tuner.py, its probe timer.py, the
script check script.py; the command line is ``python -m lightning_horizon.tune``)."""

from lightning_horizon.layout.cache import choose
from lightning_horizon.layout.rule import Layout, Machine, candidates, model_sizes, rule_layout, workload
from lightning_horizon.layout.timer import StepTimer

__all__ = ["Layout", "Machine", "StepTimer", "candidates", "choose", "model_sizes", "rule_layout", "workload"]
