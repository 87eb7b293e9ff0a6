"""``HorizonStrategy(state_store=...)``: where the out-of-core store lives and how it reads ahead."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from lightning_horizon.checks import check_int, check_one_of, require

PREFETCH = ("read", "readahead", "none")


@dataclass(frozen=True)
class StoreConfig:
    """Out-of-core training: weights, gradients, masters and optimizer state in memory-mapped files, streamed layer
    by layer (see docs/out_of_core.md)."""

    path: Optional[str] = None
    """The folder of the store (each rank creates its files there, unlinked at once: nothing is left behind).
    ``None``: next to the checkpoints (the ModelCheckpoint's ``dirpath``, else the Trainer's ``default_root_dir``),
    in ``horizon-store/``. Put it on a local disk (NVMe), not on a network file system or in ``/dev/shm``."""

    prefetch: str = "read"
    """How the next layer comes in ahead of use: ``"read"`` (the reading thread queues its files whole and maps them
    in as they arrive; measured as fast or faster than the kernel's read-ahead at 4 and 8 sequences per step, and
    its bandwidth is measured), ``"readahead"`` (``posix_fadvise(WILLNEED)``: the kernel reads ahead
    asynchronously, the first touch maps) or ``"none"`` (page faults on first touch)."""

    probe_bytes: int = 128 << 20
    """Bytes written and read back at setup to measure the folder's disk bandwidth (logged with the plan
    table); 0 skips the probe."""

    def __post_init__(self) -> None:
        require(self.path is None or isinstance(self.path, (str, os.PathLike)), "StoreConfig", "path", self.path,
                "None (next to the checkpoints) or a folder path")
        check_one_of("StoreConfig", "prefetch", self.prefetch, PREFETCH)
        check_int("StoreConfig", "probe_bytes", self.probe_bytes, 0, " (0: no disk probe)")


def resolve_store(value: Any) -> Optional[StoreConfig]:
    """``HorizonStrategy(state_store=)``: ``None`` (off), ``"auto"`` (next to the checkpoints), a folder path or a
    :class:`StoreConfig`."""
    if value is None or isinstance(value, StoreConfig):
        return value
    if value == "auto":
        return StoreConfig()
    require(isinstance(value, (str, os.PathLike)) and str(value) != "", "HorizonStrategy", "state_store", value,
            "None, 'auto' (next to the checkpoints), a folder path or a StoreConfig(...)")
    return StoreConfig(path=os.fspath(value))


__all__ = ["PREFETCH", "StoreConfig", "resolve_store"]
