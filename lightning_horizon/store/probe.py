"""The disk bandwidth of the store's folder, measured at setup: what streaming can reach, and what it needs."""

from __future__ import annotations

import os
import time

from lightning_horizon.store.files import READ_CHUNK, read_through


def disk_bandwidth(folder: str, nbytes: int) -> tuple[float, float]:
    """(read, write) bytes per second of ``folder``'s disk: ``nbytes`` written and synced, dropped from the page
    cache, read back in the store's chunks."""
    path = os.path.join(folder, f"probe-{os.getpid()}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.unlink(path)
    try:
        block = memoryview(os.urandom(min(nbytes, READ_CHUNK)))
        t0 = time.perf_counter()
        off = 0
        while off < nbytes:
            off += os.pwrite(fd, block[: min(len(block), nbytes - off)], off)
        os.fdatasync(fd)
        write = nbytes / (time.perf_counter() - t0)
        os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        read_through(fd, nbytes, memoryview(bytearray(READ_CHUNK)))
        read = nbytes / (time.perf_counter() - t0)
    finally:
        os.close(fd)
    return read, write


__all__ = ["disk_bandwidth"]
