"""Out-of-core training: the training state in memory-mapped files, streamed layer by layer (docs/out_of_core.md)."""

from lightning_horizon.store.checkpoint import StreamedCheckpointIO, load_weights, to_safetensors
from lightning_horizon.store.config import StoreConfig, resolve_store
from lightning_horizon.store.files import StoreSpaceError
from lightning_horizon.store.folder import store_folder
from lightning_horizon.store.materialize import deferred_init
from lightning_horizon.store.part import OutOfCore
from lightning_horizon.store.store import StateStore

__all__ = ["OutOfCore", "StateStore", "StoreConfig", "StoreSpaceError", "StreamedCheckpointIO", "deferred_init",
           "load_weights", "resolve_store", "store_folder", "to_safetensors"]
