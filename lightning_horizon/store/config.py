"""``HorizonStrategy(state_store=...)``: where the out-of-core store lives and how it reads ahead."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from lightning_horizon.checks import check_int, check_one_of, require

PREFETCH = ("read", "readahead", "none")
STEP = ("auto", "in_backward", "after_backward")


@dataclass(frozen=True)
class StoreConfig:
    """Out-of-core training: weights, gradients, masters and optimizer state in memory-mapped files, streamed layer
    by layer (see docs/out_of_core.md)."""

    path: Optional[str] = None
    """The folder of the store (each rank creates its files there, unlinked at once: nothing is left behind).
    ``None``: next to the checkpoints (the ModelCheckpoint's ``dirpath``, else the Trainer's ``default_root_dir``),
    in ``horizon-store/``. Put it on a local disk (NVMe), not on a network file system or in ``/dev/shm``."""

    prefetch: str = "read"
    """How the next layer comes in ahead of use: ``"read"`` (the reading threads queue its files whole and map them
    in as they arrive; measured faster than the kernel's read-ahead at 1 sequence per step and as fast at 4 and 8,
    and its bandwidth is measured), ``"readahead"`` (``posix_fadvise(WILLNEED)``: the kernel reads ahead
    asynchronously, the first touch maps) or ``"none"`` (page faults on first touch)."""

    readers: int = 2
    """Reading threads of a ``"read"`` prefetch; each reads a share of the next layer's bytes, so the disk sees that
    many requests at once (measured on a 2-core VM's disk: 2 readers 1.2-1.3x one, under training compute). More
    for a disk that wants a deeper queue (NVMe arrays)."""

    step: str = "auto"
    """When each layer's optimizer step runs: ``"in_backward"`` (as soon as the layer's gradients are complete, while
    its weights and gradients are in memory: the step reads only its optimizer state), ``"after_backward"`` (layer
    by layer once backward is over: what needs the whole gradient first, a gradient norm for clipping or
    GradNormBackoff, several ranks averaging, hooks between backward and the step, can run) or ``"auto"``: in
    backward where nothing of that is in the fit (logged with the reasons). ``"in_backward"`` with something in the
    way fails at setup, naming it."""

    probe_bytes: int = 128 << 20
    """Bytes written and read back at setup to measure the folder's disk bandwidth (logged with the plan
    table); 0 skips the probe."""

    def __post_init__(self) -> None:
        require(self.path is None or isinstance(self.path, (str, os.PathLike)), "StoreConfig", "path", self.path,
                "None (next to the checkpoints) or a folder path")
        check_one_of("StoreConfig", "prefetch", self.prefetch, PREFETCH)
        check_int("StoreConfig", "readers", self.readers, 1)
        check_one_of("StoreConfig", "step", self.step, STEP)
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


__all__ = ["PREFETCH", "STEP", "StoreConfig", "resolve_store"]
