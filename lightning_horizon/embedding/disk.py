"""A table's rows on disk: one memory-mapped file of records (a row and its optimizer state), the hot rows in memory.

:class:`DiskRows` holds one rank's rows ``[lo, hi)`` of a :class:`~lightning_horizon.embedding.ShardedEmbeddingBag`
whose rows do not fit in memory. The files are sparse: a block of :data:`~lightning_horizon.embedding.rows.BLOCK`
rows is drawn (from the table's seed, as an in-memory table draws it) and written the first time a lookup touches
it, so a table of 2^30 rows costs disk only for the blocks its ids reach. The optimizer state of a row starts as
zeros, which is what an untouched stretch of a sparse file reads as.

The cache is set-associative, as FBGEMM's: ``cache_rows`` slots in sets of :data:`WAYS`; row ``r`` may sit only in
set ``r % sets``, and a miss takes the least recently used way of its set. A row and its optimizer state move
together: read from the files when a lookup or a step needs them, written back when they are evicted dirty (or
when :meth:`flush` runs before a checkpoint); a step's misses are read by several threads at once, so that the
disk's queue stays full. The slots a step's gradient refers to stay pinned until the gradient has been taken
(:meth:`unpin`), so that no later micro-batch of the same step evicts them.

The cache changes no result: a row's values and state are moved, never recomputed, so a table on disk trains to
the same bits as the same table in memory.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import numpy as np
import torch
from torch import Tensor

WAYS = 64  #: slots per set of the cache (a step may fill half the cache before a set of it overflows, but rarely)
IO_THREADS = 16  #: threads that read a step's missed rows at once (measured here: 16 read 9x faster than 1)
SETTLE_ROWS = 1 << 16  #: rows written between two writebacks of the file's dirty pages
_NP = {torch.float32: np.float32, torch.float64: np.float64}


class CacheTooSmall(RuntimeError):
    pass


class DiskRows:
    """Rows ``[lo, hi)`` of a table (``dim`` wide, ``dtype``) and their optimizer state (``state``: name -> the
    shape of one row's state, ``()`` for a scalar per row) in files under ``folder``, ``cache_rows`` of them in
    memory. ``draw(lo, hi)`` gives the initial rows ``[lo, hi)`` (global row numbers); ``block`` is the unit it is
    called for (a block is drawn whole, the first time a row of it is needed)."""

    def __init__(self, folder: str, lo: int, hi: int, dim: int, dtype: torch.dtype, state: dict[str, tuple],
                 cache_rows: int, draw: Callable[[int, int], Tensor], block: int) -> None:
        os.makedirs(folder, exist_ok=True)
        self.folder, self.lo, self.hi, self.dim, self.dtype = folder, lo, hi, dim, dtype
        self.block, self._draw = block, draw
        self.shapes = {"weight": (dim,), **{k: tuple(v) for k, v in state.items()}}
        n = hi - lo
        # one file of records: a row's values and its state side by side, so that a miss reads one page, not one
        # per tensor; ``files``: each tensor's columns of it
        self._widths = {name: int(np.prod(shape)) for name, shape in self.shapes.items()}
        self._fd, self._mapped, self.record = _map(os.path.join(folder, "rows.bin"), n,
                                                   (sum(self._widths.values()),), dtype)
        self.files: dict[str, Tensor] = {}
        offset = 0
        for name, shape in self.shapes.items():
            width = self._widths[name]
            columns = self.record[:, offset:offset + width]
            self.files[name] = columns.view(n, *shape) if shape else columns[:, 0]  # views: writes reach the file
            offset += width
        self._records = self.record.numpy()  # the same memory, for the reading threads
        self._unsettled = 0  # rows written since the dirty pages were last sent to disk
        self.ways = max(1, min(WAYS, cache_rows, n))
        self.sets = max(1, -(-min(cache_rows, n) // self.ways))
        slots = self.sets * self.ways
        #: the cache: the rows' values and each state, one slot a row
        self.cache = {name: torch.zeros((slots, *shape), dtype=dtype) for name, shape in self.shapes.items()}
        index = torch.int32 if n < 2**31 else torch.long  # half the bookkeeping of a cache of millions of rows
        self.row_of = torch.full((self.sets, self.ways), -1, dtype=index)  # local row in each slot (-1: none)
        self.used = torch.full((self.sets, self.ways), -1, dtype=torch.int32)  # the clock at the last use
        self.dirty = torch.zeros((self.sets, self.ways), dtype=torch.bool)
        self.pinned = torch.zeros((self.sets, self.ways), dtype=torch.bool)
        first, last = lo // block, (hi - 1) // block if hi > lo else lo // block - 1
        self.first_block = first
        #: which of the blocks overlapping [lo, hi) are in the files (drawn, or loaded from a checkpoint)
        self.created = torch.zeros(max(0, last - first + 1), dtype=torch.bool)
        self._clock = 0
        #: since the start: lookups of rows found in memory, rows read from and written to the files
        self.hits = self.misses = self.reads = self.writes = 0

    @property
    def slots(self) -> int:
        return self.sets * self.ways

    @property
    def row_bytes(self) -> int:
        """Bytes of one row with its optimizer state."""
        per = torch.empty((), dtype=self.dtype).element_size()
        return sum(per * int(np.prod(s)) for s in self.shapes.values())

    # ------------------------------------------------------------------ the cache

    def ensure(self, rows: Tensor, pin: bool) -> Tensor:
        """The cache slots of ``rows`` (local row numbers, unique), read into memory where they are not; ``pin``:
        keep them until :meth:`unpin` (a gradient refers to them)."""
        self._clock += 1
        sets = rows % self.sets
        tags = self.row_of[sets]
        found = tags == rows.to(tags.dtype).unsqueeze(1)
        hit = found.any(1)
        way = found.to(torch.int8).argmax(1)
        self.used[sets[hit], way[hit]] = self._clock
        self.hits += int(hit.sum())
        miss = (~hit).nonzero().squeeze(1)
        if miss.numel():
            way[miss] = self._place(rows[miss], sets[miss])
        if pin:
            self.pinned[sets, way] = True
        return sets * self.ways + way

    def _place(self, rows: Tensor, sets: Tensor) -> Tensor:
        """Ways for missed ``rows`` in their ``sets``: each set's least recently used ways that are neither pinned
        nor used by this lookup, the evicted rows written back, the missed ones read."""
        self.misses += rows.numel()
        order = torch.argsort(sets, stable=True)
        rows, sets = rows[order], sets[order]
        uniq, counts = torch.unique_consecutive(sets, return_counts=True)
        rank = torch.arange(rows.numel()) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        key = self.used[uniq].clone()
        taken = self.pinned[uniq] | (key == self._clock)  # pinned, or holding a row of this lookup
        key[taken] = torch.iinfo(key.dtype).max
        candidates = torch.argsort(key, dim=1, stable=True)  # empty ways (-1) first, then the least recently used
        if bool(((~taken).sum(1) < counts).any()):
            raise CacheTooSmall(
                f"ShardedEmbeddingBag on disk: a step needs more rows of one cache set than it has free ways"
                f" ({self.slots:,} cache rows in {self.sets:,} sets of {self.ways}); give the table a larger"
                " cache_rows (at least a few times the distinct ids of a step, times accumulate_grad_batches)")
        way = candidates[torch.repeat_interleave(torch.arange(uniq.numel()), counts), rank]
        old = self.row_of[sets, way].long()
        evict = (old >= 0) & self.dirty[sets, way]
        if bool(evict.any()):
            slot = sets[evict] * self.ways + way[evict]
            self._write(old[evict], slot)
        self._ensure_created(rows)
        slot = sets * self.ways + way
        self._unpack(self._gather(rows), slot)
        self.reads += rows.numel()
        self.row_of[sets, way], self.used[sets, way] = rows.to(self.row_of.dtype), self._clock
        self.dirty[sets, way] = False
        out = torch.empty_like(way)
        out[order] = way
        return out

    def _write(self, rows: Tensor, slots: Tensor) -> None:
        records = torch.cat([self.cache[name][slots].reshape(rows.numel(), -1) for name in self.shapes], dim=1)
        index, values = rows.numpy(), records.numpy()
        if index.size < 16 * IO_THREADS:
            self._records[index] = values
        else:  # each write of a page not in memory reads it first: in parallel, as the reads
            shares = np.array_split(np.arange(index.size), IO_THREADS)
            list(_readers().map(lambda k: self._records.__setitem__(index[k], values[k]), shares))
        self.writes += rows.numel()
        self._unsettled += rows.numel()

    def _gather(self, rows: Tensor) -> Tensor:
        """The records of ``rows``; many of them read by :data:`IO_THREADS` threads at once (each miss is a page
        fault that waits for the disk: in parallel they keep its queue full), in row order within each share.
        numpy's take does the reading there: it lets go of the interpreter, and starts no thread pool of its own
        (torch's would spin on the cores the step computes on)."""
        index = rows.numpy()
        if index.size < 16 * IO_THREADS:
            return torch.from_numpy(np.take(self._records, index, axis=0))
        order = np.argsort(index, kind="stable")
        chunks = np.array_split(index[order], IO_THREADS)
        got = np.concatenate(list(_readers().map(lambda c: np.take(self._records, c, axis=0), chunks)))
        out = np.empty_like(got)
        out[order] = got
        return torch.from_numpy(out)

    def _unpack(self, records: Tensor, slots: Tensor) -> None:
        offset = 0
        for name, shape in self.shapes.items():
            width = self._widths[name]
            self.cache[name][slots] = records[:, offset:offset + width].reshape(-1, *shape)
            offset += width

    def mark_dirty(self, slots: Tensor) -> None:
        self.dirty.view(-1)[slots] = True

    def unpin(self) -> None:
        self.pinned.zero_()

    def rows_of(self, slots: Tensor) -> Tensor:
        """The local rows the cache ``slots`` hold."""
        return self.row_of.view(-1)[slots].long()

    def flush(self) -> None:
        """Write every dirty row back (before the files are read whole: a checkpoint)."""
        dirty = self.dirty.view(-1).nonzero().squeeze(1)
        if dirty.numel():
            self._write(self.rows_of(dirty), dirty)
            self.dirty.zero_()

    # ------------------------------------------------------------------ the files

    def _ensure_created(self, rows: Tensor) -> None:
        blocks = torch.unique((rows + self.lo) // self.block) - self.first_block
        blocks = blocks[~self.created[blocks]]
        for b in blocks.tolist():
            start = (self.first_block + b) * self.block
            lo, hi = max(start, self.lo), min(start + self.block, self.hi)
            self.files["weight"][lo - self.lo:hi - self.lo] = self._draw(lo, hi)
            self.created[b] = True
        if blocks.numel():
            self._unsettled += blocks.numel() * self.block

    def block_ranges(self) -> list[tuple[int, int]]:
        """The local row ranges of the created blocks (what a checkpoint copies)."""
        out = []
        for b in self.created.nonzero().squeeze(1).tolist():
            start = (self.first_block + b) * self.block
            out.append((max(start, self.lo) - self.lo, min(start + self.block, self.hi) - self.lo))
        return out

    def saved_rows(self, name: str, a: int, b: int) -> Tensor:
        """Global rows ``[a, b)`` (inside one block) of ``name`` as a checkpoint holds them: from the file where the
        block was made, else as the table in memory would hold them (drawn rows, zero state)."""
        if self.created[a // self.block - self.first_block]:
            return self.files[name][a - self.lo:b - self.lo]
        if name == "weight":
            return self._draw(a, b)
        return torch.zeros((b - a, *self.shapes[name]), dtype=self.dtype)

    def scratch(self, name: str, rows: int) -> Tensor:
        """A tensor of ``rows`` rows of ``name``'s shape in a file of its own, mapped to memory and already unlinked
        (its space is given back when the tensor goes)."""
        path = os.path.join(self.folder, f"scratch-{name}-{os.getpid()}.bin")
        fd, _, tensor = _map(path, rows, self.shapes[name], self.dtype)  # the scratch file of one tensor
        os.close(fd)  # the mapping keeps the file
        os.unlink(path)
        return tensor

    def load(self, name: str, rows: Tensor) -> None:
        """Replace file ``name`` by ``rows`` (this rank's, from a checkpoint), block by block; every block counts as
        made and the cache is emptied."""
        file = self.files[name]
        for a in range(0, rows.shape[0], self.block):
            file[a:a + self.block] = rows[a:a + self.block]
        self.created.fill_(True)
        self.reset_cache()

    def read(self, name: str, lo: int, hi: int) -> Tensor:
        """Local rows ``[lo, hi)`` of file ``name`` as they are on disk (after :meth:`flush`), a copy."""
        return self.files[name][lo:hi].clone()

    def settle(self, force: bool = False) -> None:
        """After a step wrote rows: once :data:`SETTLE_ROWS` have been written since the last time (or ``force``),
        their pages go to disk (writeback started, not waited for), so that the page cache they take can be given
        back when memory runs short; under a memory limit, dirty pages of a mapping that the kernel writes back only
        later would fill it (measured: OOM-killed without this). Walking the file's pages costs: not every step."""
        if force or self._unsettled >= SETTLE_ROWS:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)  # starts the writeback of the dirty pages
            self._unsettled = 0

    def reset_cache(self) -> None:
        """Forget the cache (after the files were replaced by a load)."""
        self.row_of.fill_(-1)
        self.used.fill_(-1)
        self.dirty.zero_()
        self.pinned.zero_()


_READERS: Optional[ThreadPoolExecutor] = None


def _readers() -> ThreadPoolExecutor:
    """The reading threads, one pool for every table of the process, started at the first large read."""
    global _READERS
    if _READERS is None:
        _READERS = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="table-reads")
    return _READERS


def _map(path: str, rows: int, shape: tuple, dtype: torch.dtype) -> tuple[int, mmap.mmap, Tensor]:
    """A tensor ``[rows, *shape]`` over a file of that size (sparse: made by truncate), memory-mapped and read at
    random (no read-ahead: a row is far smaller than what the kernel would read around it); with the file's
    descriptor and the mapping."""
    numel = rows * int(np.prod(shape))
    nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, nbytes)
    mapped = mmap.mmap(fd, nbytes)
    mapped.madvise(mmap.MADV_RANDOM)
    array = np.frombuffer(mapped, dtype=_NP[dtype], count=numel)
    return fd, mapped, torch.from_numpy(array).view(rows, *shape)


__all__ = ["CacheTooSmall", "DiskRows", "WAYS"]
