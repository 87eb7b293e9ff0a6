"""The disk bandwidth of the store's folder, measured at setup: what streaming can reach, and what it needs.

Streaming reads alone (forward) and while the step's write-back runs (backward, the step): a disk shares its
bandwidth between the two, so the probe measures reads both ways, and the store's metrics compare each read with
the measurement made under the same conditions.
"""

from __future__ import annotations

import errno
import os
import statistics
import threading
import time
from typing import NamedTuple, Optional

from lightning_horizon.memory.probe import fmt_bytes
from lightning_horizon.store.config import MIN_PROBE
from lightning_horizon.store.files import PAGE, READ_CHUNK, StoreSpaceError, disk_free, read_through

SYNC_EVERY = 32 << 20  # bytes the probe's writer writes between syncs (about one layer's write-back)
SLACK = 1 << 20  # bytes the probe leaves free (the file system's own blocks, the checkpoints' first bytes)


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


def probe_size(folder: str, wanted: int) -> int:
    """The probe's bytes per file in ``folder``: ``wanted`` (``StoreConfig(probe_bytes=)``), or what the disk has
    room for in two files (after the store's reservation, ``SLACK`` left free), in whole pages; a disk with room
    for less than ``MIN_PROBE`` fails here, naming the field."""
    free = disk_free(folder)
    n = min(wanted, (free - SLACK) // 2) // PAGE * PAGE
    if n < MIN_PROBE:
        raise StoreSpaceError(
            errno.ENOSPC, f"state_store: the disk probe (StoreConfig(probe_bytes={wanted})) needs 2 x"
            f" {fmt_bytes(MIN_PROBE)} at least in {folder}, after the store's own space, and {fmt_bytes(free)} are"
            " free there: free space, or pass StoreConfig(probe_bytes=0) to skip the probe")
    return n


def disk_bandwidth(folder: str, nbytes: int, repeat: int = 3) -> DiskBandwidth:
    """``folder``'s disk: ``nbytes`` written and synced, then read back from the disk ``repeat`` times alone and
    ``repeat`` times while a second file of ``nbytes`` is written over and over (medians). Both files are unlinked
    at once and given their space first: a disk without it fails before anything is measured, naming the field."""
    fds = []
    try:
        for name in ("probe", "probe-w"):
            path = os.path.join(folder, f"{name}-{os.getpid()}")
            fds.append(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
            os.unlink(path)
            os.posix_fallocate(fds[-1], 0, nbytes)
    except OSError as e:
        for f in fds:
            os.close(f)
        raise StoreSpaceError(
            e.errno, f"state_store: the disk probe cannot write 2 x {fmt_bytes(nbytes)} in {folder} ({e.strerror};"
            f" {fmt_bytes(disk_free(folder))} free there): pass a smaller StoreConfig(probe_bytes=...), or 0 to skip"
            " the probe") from e
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


__all__ = ["disk_bandwidth", "DiskBandwidth", "probe_size"]
