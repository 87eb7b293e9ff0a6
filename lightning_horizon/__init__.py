"""lightning-horizon: fast, safe language-model training on CPU machines and CPU clusters.

``import lightning_horizon`` registers the strategy's names with Lightning (``strategy="horizon"``): Lightning
has no entry point for strategies, so a name works only in a process that imported the package. The class path
(``{"class_path": "lightning_horizon.HorizonStrategy"}`` in a LightningCLI config) works without the import.
"""

import logging as _logging

from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry

from lightning_horizon import console as _console
from lightning_horizon.checkpoint_io import AtomicCheckpointIO
from lightning_horizon.callbacks import CommMonitor, GradNormBackoff, MemoryMonitor, ThroughputMFUMonitor
from lightning_horizon.collectives import CollectivesConfig, CostModel, Link
from lightning_horizon.embedding import ShardedEmbeddingBag
from lightning_horizon.precision import HorizonPrecision
from lightning_horizon.preemption import PreemptionCheckpoint
from lightning_horizon.sharding import ShardingConfig
from lightning_horizon.store import StoreConfig
from lightning_horizon.strategy import HorizonStrategy
from lightning_horizon.topology import ProcessGroups, Topology

# Like Lightning's own logger: print INFO lines (the startup table, the dtype policy, the monitors' summaries)
# unless the user set up logging themselves; above the progress bar, never onto its line.
_console.install(_logging.getLogger(__name__))

HorizonStrategy.register_strategies(_StrategyRegistry)  # "horizon", "horizon_spawn", "horizon_fork"
# The class given as a plain string (`--trainer.strategy=lightning_horizon.HorizonStrategy` or `=HorizonStrategy`,
# `strategy: lightning_horizon.HorizonStrategy` in YAML): with no option after it, LightningCLI hands it to the
# Trainer as a name, which Lightning lower-cases and looks up in its registry.
for _path in ("lightning_horizon.HorizonStrategy", "lightning_horizon.strategy.HorizonStrategy", "HorizonStrategy"):
    if _path.lower() not in _StrategyRegistry:
        _StrategyRegistry.register(_path.lower(), HorizonStrategy, description="HorizonStrategy with its defaults")

__all__ = [
    "AtomicCheckpointIO",
    "CollectivesConfig",
    "CommMonitor",
    "CostModel",
    "GradNormBackoff",
    "HorizonPrecision",
    "HorizonStrategy",
    "Link",
    "MemoryMonitor",
    "PreemptionCheckpoint",
    "ProcessGroups",
    "ShardedEmbeddingBag",
    "ShardingConfig",
    "StoreConfig",
    "ThroughputMFUMonitor",
    "Topology",
]
__version__ = "0.1.0"
