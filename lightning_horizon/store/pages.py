"""The page movement of a store's files: a unit's pages in ahead of its use, out after it.

The reading threads (``readers`` of them) bring a unit's files into the page cache ahead of its use, each a
contiguous share of its bytes (:meth:`UnitPages.prefetch`); after the use the files leave this process's memory
(:meth:`UnitPages.release`: unmapped, and dirty ones written back on a thread of their own, so that a read never
waits behind a write; clean pages dropped from the page cache at once). A walk over the parameters goes unit by unit
(:meth:`UnitPages.stream`), the next unit read in while the caller works on one. Pinned units keep their weights
mapped. The prefetches that reached the disk are measured (:attr:`UnitPages.reads`): the read bandwidth achieved
alone and while a write-back ran.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Optional

from torch import Tensor

from lightning_horizon.store.files import READ_CHUNK, MappedFile, before_compute, io_counters
from lightning_horizon.store.sizes import GRAD, WEIGHT, split
from lightning_horizon.store.units import Unit


class UnitPages:
    """The units' files (``(unit index, kind)`` -> file), which of them are dirty and pinned, and the reading and the
    writing threads that move their pages; the base of :class:`~lightning_horizon.store.store.StateStore`, which
    creates the files."""

    def __init__(self, units: list[Unit], prefetch: str, readers: int) -> None:
        self.units = units
        self.prefetch_mode = prefetch
        self.unit_of: dict[int, Unit] = {id(p): u for u in units for p in u.params}
        self._files: dict[tuple[int, str], MappedFile] = {}
        self._dirty: set[tuple[int, str]] = set()
        #: streamed units whose weights stay mapped, as measured memory allows (OutOfCore decides)
        self.pinned: set[int] = set()
        self._inflight: dict[int, list[Future]] = {}
        # reads ahead and writes back on threads of their own: a read for the next unit never waits behind a write;
        # ``readers`` threads share each unit's bytes (a deeper queue for the disk)
        self.readers = readers
        self._reader = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="horizon-store-read",
                                          initializer=before_compute)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="horizon-store-write")
        self._scratch = threading.local()  # each reading thread's buffer where MADV_POPULATE_READ is missing
        self._lock = threading.Lock()
        #: bytes and wall seconds of the reading threads' prefetches that reached the disk (achieved read bandwidth;
        #: ``prefetch="read"`` only), by whether a write-back ran at the same time ("shared") or not ("alone")
        self.reads: dict[str, list[float]] = {"alone": [0, 0.0], "shared": [0, 0.0]}
        self._writing = 0  # write-backs running now
        self._writes = 0  # write-backs started so far
        self._reading = 0  # prefetch jobs running now
        self._period: tuple[float, int, bool] = (0.0, 0, False)  # reads since: t0, writes started, one running
        self._period_bytes = 0

    def _kinds(self, u: Unit, *leave_out: str) -> list[str]:
        """The kinds of ``u``'s files, but ``leave_out``."""
        return [k for i, k in self._files if i == u.index and k not in leave_out]

    def _unit_files(self, u: Unit, kinds: Optional[Iterable[str]] = None) -> list[tuple[tuple[int, str], MappedFile]]:
        want = None if kinds is None else set(kinds)
        return [(k, f) for k, f in self._files.items() if k[0] == u.index and (want is None or k[1] in want)]

    def prefetch(self, u: Unit, kinds: Optional[Iterable[str]] = None) -> None:
        """Start bringing ``u``'s files (of ``kinds``; all by default) into the page cache, its bytes shared out
        among the reading threads."""
        if self.prefetch_mode == "none" or any(not j.done() for j in self._inflight.get(u.index, ())):
            return
        files = [f for key, f in self._unit_files(u, kinds) if not (key[1] == WEIGHT and u.index in self.pinned)]
        self._inflight[u.index] = [self._reader.submit(self._prefetch_job, part)
                                   for part in split(files, self.readers)]

    def _prefetch_job(self, ranges: list[tuple[MappedFile, int, int]]) -> None:
        with self._lock:
            if not self._reading:  # the reading threads get busy: a period of reads starts
                self._period, self._period_bytes = (time.perf_counter(), self._writes, self._writing > 0), 0
            self._reading += 1
        r0, _ = io_counters()
        try:
            for f, start, end in ranges:
                f.prefetch(self.prefetch_mode, self._thread_scratch(), start, end)
        finally:
            r1, _ = io_counters()
            with self._lock:
                self._reading -= 1
                self._period_bytes += r1 - r0
                if not self._reading:
                    self._end_period()

    def _end_period(self) -> None:
        """The reading threads are idle: the period's bytes over its wall time, counted as read alone or with a
        write-back running at some point of it. ``"readahead"`` returns once the reads are queued: no measure."""
        t0, writes, writing = self._period
        if self._period_bytes > 0 and self.prefetch_mode == "read":
            acc = self.reads["shared" if writing or self._writing or self._writes != writes else "alone"]
            acc[0] += self._period_bytes
            acc[1] += time.perf_counter() - t0

    def _thread_scratch(self) -> Optional[memoryview]:
        if self.prefetch_mode != "read":
            return None
        buf = getattr(self._scratch, "buf", None)
        if buf is None:
            buf = self._scratch.buf = memoryview(bytearray(READ_CHUNK))
        return buf

    def _write_back(self, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` on the writing thread, counted (a read that overlaps it shares the disk with it)."""
        def job() -> None:
            with self._lock:
                self._writing += 1
                self._writes += 1
            try:
                fn(*args)
            finally:
                with self._lock:
                    self._writing -= 1
        self._writer.submit(job)

    def release(self, u: Unit, kinds: Optional[Iterable[str]] = None) -> None:
        """``u``'s files (of ``kinds``) leave this process's memory now; dirty ones are written back (writing thread).
        The weights of the resident unit and of pinned units stay mapped (written back when dirty)."""
        for key, f in self._unit_files(u, kinds):
            dirty = key in self._dirty
            self._dirty.discard(key)
            if key[1] == WEIGHT and (not u.streamed or u.index in self.pinned):
                if dirty:
                    self._write_back(os.fdatasync, f.fd)
                continue
            f.unmap()
            if dirty:
                self._write_back(f.writeback, True)
            else:  # clean pages leave the page cache at once: a read under a memory limit reclaims nothing
                f.writeback(False)

    def pin(self, u: Unit) -> None:
        """Keep ``u``'s weights mapped from now on (no reads of them in forward, backward and the step)."""
        self.pinned.add(u.index)

    def unpin(self, u: Unit) -> None:
        self.pinned.discard(u.index)
        self.release(u, (WEIGHT,))

    def mark_dirty(self, units: Iterable[int], kinds: Optional[Iterable[str]] = None) -> None:
        for i in units:
            for key, _ in self._unit_files(self.units[i], kinds):
                self._dirty.add(key)

    def stream(self, params: Iterable[Tensor], key: Callable[[Tensor], Tensor] = lambda p: p, dirty: bool = False,
               kinds: tuple[str, ...] = (GRAD,)) -> Iterator[list[Tensor]]:
        """``params`` in their order, in runs that share a unit (that of ``key(p)``: a master's parameter): the next
        unit's ``kinds`` files brought in ahead while the caller works on a run, a run's released when it asks for the
        next (written back when the caller wrote to them: ``dirty``)."""
        params = list(params)
        units = [self.unit_of.get(id(key(p))) for p in params]
        start = 0
        for end in range(1, len(params) + 1):
            if end < len(params) and units[end] is units[start]:
                continue
            unit = units[start]
            nxt = next((v for v in units[end:] if v is not unit and v is not None), None)
            if nxt is not None:
                self.prefetch(nxt, kinds)
            yield params[start:end]
            self._leave(unit, dirty, kinds)
            start = end

    def _leave(self, u: Optional[Unit], dirty: bool, kinds: tuple[str, ...]) -> None:
        if u is None:
            return
        if dirty:
            self.mark_dirty([u.index], kinds)
        self.release(u, kinds)

    def drain(self) -> None:
        """Wait for every queued prefetch and write-back."""
        for jobs in self._inflight.values():
            for j in jobs:
                j.result()
        self._written()

    def _written(self) -> None:
        """Wait for every queued write-back."""
        self._writer.submit(lambda: None).result()

    def _stop_threads(self) -> None:
        """Wait for the reading and the writing threads to finish, and end them."""
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)


__all__ = ["UnitPages"]
