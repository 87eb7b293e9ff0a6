"""AtomicCheckpointIO: a checkpoint file is either the old one or the complete new one, never half of either.

The checkpoint is streamed by ``torch.save`` into a temporary file in the target's own directory (same file
system, so the rename is atomic), flushed and fsynced, then renamed over the target, and the directory is
fsynced so the rename itself survives a power loss. A process killed at any point leaves the previous
checkpoint intact and, at worst, a ``.tmp`` file that the next save in that directory removes.

Unlike Lightning's default (which serializes into an in-memory buffer first), nothing is held in memory twice:
that matters for the large checkpoints CPU machines write. Loading memory-maps the file (``torch.load(mmap=True)``):
every rank of a node reads the same page cache instead of deserializing its own copy, and what a rank does not take
(node-sharded state keeps its own share of the optimizer state) is never read. Remote paths (``s3://`` ...) go to
Lightning's own implementation. ``atomic_file`` is the same write for any file (the layout cache uses it).

``AtomicCheckpointIO(background=True)``: a save snapshots the checkpoint's tensors in memory (one copy, on the
training thread: the next optimizer step cannot tear it) and writes it, atomically as above, on a thread of its own
while the next steps run. One write is in flight at most: a save that comes while the previous one still writes waits
for it (memory holds one snapshot, never a queue). A removal (ModelCheckpoint's of older checkpoints) runs on the same
thread after the writes before it, so it never races a write in flight; a load of a path waits for the writes before
it. A write that fails fails the job: its error is raised on the training thread at the next save, removal, load or
teardown, and logged at once. ``wait()`` returns when every write so far is on disk (a preemption calls it before the
process ends).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, BinaryIO, Callable, Iterator, Optional, Union

import torch
from fsspec.utils import get_protocol
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_horizon.checks import require

log = logging.getLogger("lightning_horizon.strategy")

_TMP_SUFFIX = ".horizon.tmp"


def _is_local(path: Any) -> bool:
    """A path on this machine's file system (``"file"`` protocol, as Lightning's own checkpoint IO decides it)."""
    return get_protocol(str(path)) == "file"


class AtomicCheckpointIO(TorchCheckpointIO):
    """HorizonStrategy's default CheckpointIO: temporary file, fsync, atomic rename.

    Args:
        background: snapshot in memory and write on a thread of its own while training goes on (module docstring).
    """

    def __init__(self, background: bool = False) -> None:
        super().__init__()
        self.background = background
        self._executor: Optional[ThreadPoolExecutor] = None
        self._inflight: Optional[Future] = None  # the last write or removal handed to the thread
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if not self.background:
            self._write(checkpoint, path, storage_options)
            return
        self.wait()  # one snapshot in memory at most; raises a failed write's error here, on the training thread
        snapshot = apply_to_collection(checkpoint, torch.Tensor, _snapshot)
        self._submit(self._write, snapshot, path, storage_options)

    def _write(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any]) -> None:
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        with atomic_file(path) as f:
            torch.save(checkpoint, f)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        if not self.background:
            super().remove_checkpoint(path)
            return
        self._raise_failed()
        self._submit(super().remove_checkpoint, path)  # after the writes before it, on their thread

    def _submit(self, work: Callable[..., None], *args: Any) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="horizon-checkpoint")

        def run() -> None:
            try:
                work(*args)
            except BaseException as error:  # kept for the training thread, which raises it
                log.error(f"HorizonStrategy: a background checkpoint write failed ({type(error).__name__}: {error});"
                          " the job fails at its next checkpoint; the previous checkpoint is intact")
                with self._lock:
                    self._error = self._error or error

        self._inflight = self._executor.submit(run)

    def wait(self) -> None:
        """Return when every write and removal handed over so far is done; raise the first that failed."""
        if self._inflight is not None:
            self._inflight.result()
            self._inflight = None
        self._raise_failed()

    def _raise_failed(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"HorizonStrategy: a background checkpoint write failed: {error}") from error

    @override
    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    @override
    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = lambda storage, loc: storage, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        self.wait()  # a checkpoint still being written is read once it is whole
        if not _is_local(path) or not os.path.isfile(path) or not zipfile.is_zipfile(path):
            return super().load_checkpoint(path, map_location, weights_only)  # remote, missing, or the legacy format
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=True)


def or_atomic(checkpoint_io: Any) -> CheckpointIO:
    """The strategy's ``checkpoint_io``: the one given (a Lightning ``CheckpointIO``), else an atomic one."""
    require(checkpoint_io is None or isinstance(checkpoint_io, CheckpointIO), "HorizonStrategy", "checkpoint_io",
            checkpoint_io, "a lightning CheckpointIO or None (atomic)")
    return checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO()


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A point-in-time copy of ``t``, made on the training thread (the next step writes the original in place)."""
    return t.detach().clone()


@contextmanager
def atomic_file(path: Union[str, os.PathLike]) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` only when the block ends without an error: written to a temporary file
    in the same directory, fsynced, renamed over ``path``, the directory fsynced; the previous ``path`` is intact
    until then, and a temporary file left by a process killed mid-write is removed by the next write."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    _remove_stale_tmp(directory, os.path.basename(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=_TMP_SUFFIX, dir=directory)
    try:
        # mkstemp creates the file 0600; torch.save and Lightning's own IO create it 0666 minus the umask
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def _remove_stale_tmp(directory: str, name: str) -> None:
    """Temporary files of this target left by a process killed mid-save."""
    prefix = f".{name}."
    for entry in os.listdir(directory):
        if entry.startswith(prefix) and entry.endswith(_TMP_SUFFIX):
            try:
                os.remove(os.path.join(directory, entry))
            except OSError:
                pass


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory
    finally:
        os.close(fd)
