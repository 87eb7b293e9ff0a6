"""One memory-mapped file of the out-of-core store: tensors as views into it, and the calls that move its pages.

A file is created in the store's folder, given its full size on disk at once (``posix_fallocate``: a full disk
fails here, at setup, never in the middle of a step), mapped ``MAP_SHARED`` and unlinked: the mapping is all that
is left, so nothing stays behind after a crash, and the disk space returns when the last tensor viewing it dies.
The tensors are ordinary CPU tensors whose memory is the page cache of that file: the kernel reads a page in on
first touch and may write it back and drop it whenever memory is short. The store decides when that happens:

- :meth:`prefetch`: bring the file in ahead of use (``"read"``: the whole file queued with
  ``posix_fadvise(WILLNEED)``, then mapped in as it arrives with ``madvise(MADV_POPULATE_READ)`` on the reading
  thread, GIL released, so that it returns when the data is in memory, with no copy; before Linux 5.14 read
  through with ``preadv`` instead; ``"readahead"``: ``posix_fadvise(WILLNEED)`` alone, the kernel's asynchronous
  read-ahead, faulted in by the first touch; ``"none"``: page faults on first touch).
- :meth:`discard`: forget bytes about to be overwritten whole (``fallocate(FALLOC_FL_ZERO_RANGE)``: the blocks stay
  allocated, the next touch reads nothing from the disk). New gradients placed over last step's would otherwise
  read last step's bytes back first, page by page (and the read-ahead around them).
- :meth:`unmap`: drop the pages from this process's address space (``madvise(DONTNEED)``: resident memory falls
  at once; dirty pages stay in the page cache, nothing is lost).
- :meth:`writeback`: write dirty pages to disk (``fdatasync``) and drop the clean page cache (``posix_fadvise
  (DONTNEED)``): the memory goes back to the machine (and out of a cgroup's charge).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from typing import Optional

import torch
from torch import Tensor

from lightning_horizon.memory.probe import fmt_bytes

PAGE = mmap.PAGESIZE
READ_CHUNK = 2 << 20  # bytes per preadv of a "read" prefetch (its scratch buffer is resident)


class StoreSpaceError(OSError):
    """The store's folder cannot take the store (full disk, quota, no write permission): raised at setup."""


_MADV_POPULATE_READ = 22  # Linux 5.14+
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_populate_works = True
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_ZERO_RANGE = 0x01, 0x10  # Linux 3.15+: ext4, xfs (not tmpfs)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _populate(addr: int, length: int) -> bool:
    """Fault ``length`` bytes of a mapping in, reading what is not in the page cache (``MADV_POPULATE_READ``,
    through ctypes: the GIL is released while the disk reads). False where the kernel does not know it."""
    global _populate_works
    if not _populate_works:
        return False
    if _libc.madvise(addr, length, _MADV_POPULATE_READ) == 0:
        return True
    _populate_works = ctypes.get_errno() != errno.EINVAL
    return False


def read_through(fd: int, end: int, scratch: memoryview, start: int = 0) -> None:
    """Read bytes ``start:end`` of ``fd`` in ``scratch``-sized pieces (into the page cache, and ``scratch``)."""
    off = start
    while off < end:
        n = os.preadv(fd, [scratch[: min(len(scratch), end - off)]], off)
        if n <= 0:
            break
        off += n


def disk_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def align(n: int) -> int:
    return -(-n // PAGE) * PAGE


class MappedFile:
    """``nbytes`` of disk in ``folder``, mapped and unlinked; :meth:`view` carves tensors out of it."""

    def __init__(self, folder: str, name: str, nbytes: int) -> None:
        self.path = os.path.join(folder, name)
        self.nbytes = align(max(nbytes, 1))
        self.used = 0
        self._zero_range = True  # until the file system says it has no FALLOC_FL_ZERO_RANGE
        try:
            self.fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as e:
            raise StoreSpaceError(e.errno, f"state_store: cannot create {self.path}: {e.strerror}") from e
        try:
            try:
                os.posix_fallocate(self.fd, 0, self.nbytes)
            except OSError as e:
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                hint = f" ({fmt_bytes(disk_free(folder))} free there)" if full else ""
                raise StoreSpaceError(
                    e.errno, f"state_store: cannot reserve {fmt_bytes(self.nbytes)} for {self.path}: {e.strerror}{hint}"
                ) from e
            self._map = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.raw = torch.frombuffer(self._map, dtype=torch.uint8)
        except BaseException:
            os.close(self.fd)
            raise
        finally:
            os.unlink(self.path)

    def view(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """The next free bytes (64-byte aligned) as a tensor of ``shape`` and ``dtype``."""
        start = -(-self.used // 64) * 64
        n = shape.numel() * torch.empty((), dtype=dtype).element_size()
        if start + n > self.nbytes:
            raise RuntimeError(f"state_store: {self.path} holds {self.nbytes} bytes, {start + n} needed")
        self.used = start + n
        return self.raw[start : start + n].view(dtype).view(shape)

    # ------------------------------------------------------------------ page movement

    def prefetch(self, mode: str, scratch: Optional[memoryview] = None, start: int = 0,
                 end: Optional[int] = None) -> int:
        """Bring bytes ``start:end`` (page-aligned ``start``; default: all it holds) into the page cache ahead of use;
        returns the bytes asked for."""
        end = self.used if end is None else min(end, self.used)
        if self.fd < 0 or end <= start:
            return 0
        if mode == "readahead":
            os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_WILLNEED)
        elif mode == "read":
            assert scratch is not None
            # the whole range queued at once (the disk gets deep, large requests), then mapped in as it arrives
            # (no copy): when this returns the range is in memory, and the time it took measures the disk
            os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_WILLNEED)
            if _populate(self.raw.data_ptr() + start, align(end) - start):
                return end - start
            read_through(self.fd, end, scratch, start)  # a kernel without MADV_POPULATE_READ (< 5.14)
        return end - start

    def discard(self, start: int, end: int) -> None:
        """Bytes ``start:end`` are about to be overwritten whole: their whole pages become zeros on the disk's side
        (still allocated: the write-back cannot fail for space) and leave the page cache, so writing them reads
        nothing first. The partial pages at either end are kept. A file system without ``FALLOC_FL_ZERO_RANGE``
        skips it."""
        start, end = align(start), (self.nbytes if end >= self.used else end // PAGE * PAGE)  # past used: nobody's
        if self.fd < 0 or end <= start or not self._zero_range:
            return
        if _libc.fallocate(self.fd, _FALLOC_FL_ZERO_RANGE | _FALLOC_FL_KEEP_SIZE, start, end - start) != 0:
            self._zero_range = ctypes.get_errno() not in (errno.EOPNOTSUPP, errno.ENOSYS)

    def unmap(self) -> None:
        """Leave this process's resident set (the data stays in the page cache or on disk)."""
        self._map.madvise(mmap.MADV_DONTNEED, 0, self.nbytes)

    def writeback(self, dirty: bool) -> None:
        """Dirty pages to disk (``dirty``), then the file's clean pages out of the page cache."""
        if self.fd < 0:
            return
        if dirty:
            os.fdatasync(self.fd)
        os.posix_fadvise(self.fd, 0, self.nbytes, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close the descriptor; the mapping lives on as long as a tensor views it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Reservation:
    """Disk space held in an unlinked file until :meth:`take` hands it, piece by piece, to the files it was for."""

    def __init__(self, folder: str, nbytes: int, what: str) -> None:
        path = os.path.join(folder, f"reserve-{os.getpid()}")
        self.nbytes = 0
        self.fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.unlink(path)
        try:
            os.posix_fallocate(self.fd, 0, max(nbytes, 1))
        except OSError as e:
            os.close(self.fd)
            raise StoreSpaceError(
                e.errno, f"state_store: {folder} cannot take the {fmt_bytes(nbytes)} ({nbytes} bytes) that {what}"
                f" will need ({e.strerror}; {fmt_bytes(disk_free(folder))} free there): free space or pass another"
                " folder (HorizonStrategy(state_store=StoreConfig(path=...)))"
            ) from e
        self.nbytes = nbytes

    def take(self, nbytes: int) -> None:
        """Give ``nbytes`` back to the file system (for a file about to be created in its place)."""
        self.nbytes = max(0, self.nbytes - nbytes)
        if self.fd >= 0:
            os.ftruncate(self.fd, self.nbytes)
            if self.nbytes == 0:
                os.close(self.fd)
                self.fd = -1


def io_counters(path: str = "/proc/thread-self/io") -> tuple[int, int]:
    """(read_bytes, write_bytes) this thread (or process) sent to storage so far; (0, 0) where not readable."""
    try:
        with open(path) as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def before_compute() -> None:
    """A reading thread runs before the compute threads when both are ready (it needs the CPU briefly, between
    waits on the disk); without the permission to raise a priority, it stays as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
    except OSError:
        pass


__all__ = ["MappedFile", "Reservation", "read_through", "StoreSpaceError", "disk_free", "align", "PAGE", "before_compute",
           "io_counters"]
