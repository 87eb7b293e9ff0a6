"""``HorizonStrategy(state_store=...)``: where the out-of-core store lives and how it reads ahead."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_horizon.checks import check_one_of, is_int, require

PREFETCH = ("read", "readahead", "none")
STEP = ("auto", "in_backward", "after_backward")
MAX_READERS = 64
MIN_PROBE = 1 << 20


@dataclass(frozen=True)
class StoreConfig:
    """Out-of-core training: weights, gradients, masters and optimizer state in memory-mapped files, streamed layer
    by layer (see docs/out_of_core.md)."""

    path: Optional[str] = None
    """The folder of the store: each fit and rank works in a subfolder of its own there (its files unlinked at once),
    removed at teardown; the folder and anything else in it stay, so fits may share it (store/folder.py).
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
    for a disk that wants a deeper queue (NVMe arrays); at most ``MAX_READERS`` (64)."""

    step: str = "auto"
    """When each layer's optimizer step runs: ``"in_backward"`` (as soon as the layer's gradients are complete, while
    its weights and gradients are in memory: the step reads only its optimizer state), ``"after_backward"`` (layer
    by layer once backward is over: what needs the whole gradient first, a gradient norm for clipping or
    GradNormBackoff, several ranks averaging, hooks between backward and the step, can run) or ``"auto"``: in
    backward where nothing of that is in the fit (logged with the reasons). ``"in_backward"`` with something in the
    way fails at setup, naming it."""

    probe_bytes: int = 128 << 20
    """Bytes written and read back at setup to measure the folder's disk bandwidth (logged with the plan
    table), in two files of this size, after the store's own space is reserved: where less is free the probe
    shrinks to what is (down to 1 MiB; below that setup fails, naming this field). 0 skips the probe; else at
    least 1 MiB."""

    pretrained: Union[None, str, os.PathLike, tuple] = None
    """Safetensors file(s) (a path or a tuple of paths) whose tensors become the model's weights at setup, read one
    tensor at a time into the store's files (``safetensors.safe_open`` maps each file): a model declared on the meta
    device (``trainer.init_module(empty_init=True)``, ``configure_model``) is never built in memory. A name in the
    files is the model's parameter or buffer name after ``pretrained_prefix``; a parameter not in the files keeps its
    init (logged). ``None``: the model's own init (declared on the meta device: replayed into the store)."""

    pretrained_prefix: Optional[str] = None
    """What comes before the files' names in the LightningModule's parameter names (``"model."`` for a Hugging Face
    model held as ``self.model``); ``None``: found from the first name in the files that ends a parameter's name."""

    def __post_init__(self) -> None:
        require(self.path is None or _folder_path(self.path), "StoreConfig", "path", self.path,
                "None (next to the checkpoints) or a folder path (non-empty, a str or os.PathLike, no NUL byte)")
        check_one_of("StoreConfig", "prefetch", self.prefetch, PREFETCH)
        require(is_int(self.readers, 1) and self.readers <= MAX_READERS, "StoreConfig", "readers", self.readers,
                f"an int >= 1 and <= {MAX_READERS} (reading threads)")
        check_one_of("StoreConfig", "step", self.step, STEP)
        require(is_int(self.probe_bytes) and (self.probe_bytes == 0 or self.probe_bytes >= MIN_PROBE), "StoreConfig",
                "probe_bytes", self.probe_bytes, f"an int >= 0: 0 (no disk probe) or at least {MIN_PROBE} (1 MiB:"
                " a smaller probe measures the page cache, not the disk)")
        paths = self.pretrained if isinstance(self.pretrained, tuple) else (self.pretrained,) if self.pretrained \
            is not None else ()
        require(all(_folder_path(x) for x in paths) and (self.pretrained is None or paths), "StoreConfig",
                "pretrained", self.pretrained, "None, a safetensors file's path or a tuple of paths")
        require(self.pretrained_prefix is None or isinstance(self.pretrained_prefix, str), "StoreConfig",
                "pretrained_prefix", self.pretrained_prefix, "None (found from the names) or a str")

    @property
    def pretrained_paths(self) -> tuple[str, ...]:
        """``pretrained`` as a tuple of paths."""
        if self.pretrained is None:
            return ()
        return tuple(map(os.fspath, self.pretrained if isinstance(self.pretrained, tuple) else (self.pretrained,)))


def _folder_path(value: Any) -> bool:
    """A str or os.PathLike naming a folder: not empty, no NUL byte (the OS refuses those only at the first use)."""
    if not isinstance(value, (str, os.PathLike)):
        return False
    path = os.fspath(value)
    return isinstance(path, str) and path != "" and "\0" not in path


def resolve_store(value: Any) -> Optional[StoreConfig]:
    """``HorizonStrategy(state_store=)``: ``None`` (off), ``"auto"`` (next to the checkpoints), a folder path or a
    :class:`StoreConfig`."""
    if value is None or isinstance(value, StoreConfig):
        return value
    if value == "auto":
        return StoreConfig()
    require(_folder_path(value), "HorizonStrategy", "state_store", value,
            "None, 'auto' (next to the checkpoints), a folder path or a StoreConfig(...)")
    return StoreConfig(path=os.fspath(value))


__all__ = ["MAX_READERS", "MIN_PROBE", "PREFETCH", "STEP", "StoreConfig", "resolve_store"]
