"""Out-of-core training: the training state in memory-mapped files, streamed layer by layer (docs/out_of_core.md).

- store.py: :class:`StateStore`, one rank's store: the tensors' views in the files, the streaming hooks, the
  gradients' arrival in backward;
- pages.py: the page movement of its files: prefetch on the reading threads, release and write-back, pinned
  units, a walk unit by unit, the read bandwidth achieved;
- files.py: one mapped, unlinked file and the calls that move its pages; sizes.py: the files' kinds and bytes;
- units.py: the layers streamed and the resident rest; step.py: the optimizer step layer by layer;
- materialize.py: a model declared on the meta device, built layer by layer into the store;
- checkpoint.py: checkpoints written and read without building the model; config.py: ``state_store=``'s options;
- folder.py: one fit's subfolder; probe.py: the disk's bandwidth; reserve.py: the optimizer state to come;
- part.py: :class:`OutOfCore`, the strategy part.
"""

from lightning_horizon.store.checkpoint import StreamedCheckpointIO, load_weights, to_safetensors
from lightning_horizon.store.config import StoreConfig, resolve_store
from lightning_horizon.store.files import StoreSpaceError
from lightning_horizon.store.folder import store_folder
from lightning_horizon.store.materialize import deferred_init
from lightning_horizon.store.part import OutOfCore
from lightning_horizon.store.store import StateStore

__all__ = ["OutOfCore", "StateStore", "StoreConfig", "StoreSpaceError", "StreamedCheckpointIO", "deferred_init",
           "load_weights", "resolve_store", "store_folder", "to_safetensors"]
