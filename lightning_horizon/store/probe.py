"""The disk bandwidth of the store's folder, measured at setup: what streaming can reach, and what it needs.

Streaming reads alone (forward) and while the step's write-back runs (backward, the step): a disk shares its
bandwidth between the two, so the probe measures reads both ways, and the store's metrics compare each read with
the measurement made under the same conditions.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import NamedTuple, Optional

from lightning_horizon.store.files import READ_CHUNK, read_through

SYNC_EVERY = 32 << 20  # bytes the probe's writer writes between syncs (about one layer's write-back)


class DiskBandwidth(NamedTuple):
    """Bytes per second of one folder's disk."""

    read: float  #: reading alone
    write: float  #: writing alone (written and synced)
    shared_read: float  #: reading while another thread writes and syncs without pause (the step's write-back)


def _write(fd: int, nbytes: int, block: memoryview, stop: Optional[threading.Event] = None) -> None:
    off = 0
    while off < nbytes and not (stop is not None and stop.is_set()):
        off += os.pwrite(fd, block[: min(len(block), nbytes - off)], off)
        if off % SYNC_EVERY == 0:
            os.fdatasync(fd)
    os.fdatasync(fd)


def _read(fd: int, nbytes: int) -> float:
    """Seconds to read ``nbytes`` of ``fd``, dropped from the page cache first, in the store's chunks."""
    os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    read_through(fd, nbytes, memoryview(bytearray(READ_CHUNK)))
    return time.perf_counter() - t0


def disk_bandwidth(folder: str, nbytes: int, repeat: int = 3) -> DiskBandwidth:
    """``folder``'s disk: ``nbytes`` written and synced, then read back from the disk ``repeat`` times alone and
    ``repeat`` times while a second file of ``nbytes`` is written over and over (medians)."""
    fds = []
    for name in ("probe", "probe-w"):
        path = os.path.join(folder, f"{name}-{os.getpid()}")
        fds.append(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        os.unlink(path)
    fd, other = fds
    try:
        block = memoryview(os.urandom(min(nbytes, READ_CHUNK)))
        t0 = time.perf_counter()
        _write(fd, nbytes, block)
        write = nbytes / (time.perf_counter() - t0)
        alone, shared = [], []
        for _ in range(repeat):
            alone.append(nbytes / _read(fd, nbytes))
            stop = threading.Event()

            def writer() -> None:
                while not stop.is_set():
                    _write(other, nbytes, block, stop)
                    os.posix_fadvise(other, 0, nbytes, os.POSIX_FADV_DONTNEED)

            thread = threading.Thread(target=writer, name="horizon-store-probe", daemon=True)
            thread.start()
            try:
                time.sleep(0.01)  # the writes under way before the reads start
                shared.append(nbytes / _read(fd, nbytes))
            finally:
                stop.set()
                thread.join()
    finally:
        for f in fds:
            os.close(f)
    return DiskBandwidth(statistics.median(alone), write, statistics.median(shared))


__all__ = ["disk_bandwidth", "DiskBandwidth"]
