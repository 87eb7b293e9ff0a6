"""lightning-horizon: fast, safe language-model training on CPU machines and CPU clusters."""

import logging as _logging

from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry

from lightning_horizon.callbacks import CommMonitor, GradNormBackoff, MemoryMonitor, ThroughputMFUMonitor
from lightning_horizon.precision import HorizonPrecision
from lightning_horizon.strategy import HorizonStrategy
from lightning_horizon.topology import ProcessGroups, Topology

# Like Lightning's own logger: print INFO lines (the startup table, the dtype policy) unless the user set up
# logging themselves.
_logger = _logging.getLogger(__name__)
_logger.setLevel(_logging.INFO)
if not _logging.getLogger().hasHandlers():
    _logger.addHandler(_logging.StreamHandler())
    _logger.propagate = False

HorizonStrategy.register_strategies(_StrategyRegistry)  # "horizon", "horizon_spawn", "horizon_fork"

__all__ = [
    "CommMonitor",
    "GradNormBackoff",
    "HorizonPrecision",
    "HorizonStrategy",
    "MemoryMonitor",
    "ProcessGroups",
    "ThroughputMFUMonitor",
    "Topology",
]
__version__ = "0.1.0"
