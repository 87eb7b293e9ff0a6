"""The allreduce algorithms, in place on one flat tensor: flat, and two-level (hierarchical / 2D torus).

The tensor is fp32, or bf16 when bf16 gradients go uncompressed; the sums are fp32 either way.

Each leaves the world's sum divided by ``divisor`` in the tensor and returns, when compressing, what this rank's
encodings lost, as ``(offset, values)`` pieces of the tensor's layout, zero elsewhere (the error feedback's new
residual, in units of the sum). Every collective is issued from the caller's thread, in an order that depends only
on the tensor's size, so it is the same on every rank; the works a pipeline leaves running are waited for by that
same thread. No collective ever runs from a ``Future.then`` callback.

In place, because a fresh bucket-sized tensor per call costs page faults: with glibc malloc, a 64 MiB
allocation is an mmap that is returned on free, and copying a bucket into a new one took as long as sending it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

import torch
import torch.nn.functional as F

from lightning_horizon.collectives.comm import Comm
from lightning_horizon.collectives.compression import Codec, CompressedAllreduce, compressed_allreduce
from lightning_horizon.collectives.chunks import chunk_sizes

#: ``(offset, values)``: a piece of a tensor's layout
Pieces = list[tuple[int, torch.Tensor]]


def narrow(x: torch.Tensor) -> bool:
    """bf16 (or fp16): gloo's allreduce would sum it in its own type, rounding every partial sum."""
    return x.element_size() < 4


def flat(x: torch.Tensor, world: Comm, codec: Optional[Codec], divisor: int) -> Optional[Pieces]:
    """One allreduce over the world (compressed: all-to-all, fp32 sum, all-gather).

    A bf16 tensor (bf16-true weights) never goes through gloo's allreduce, which adds in bf16 and rounds every
    partial sum: it is reduce-scattered and all-gathered in bf16 (the bytes of a bf16 allreduce), summed in fp32
    in between, so the result is the fp32 sum rounded once.
    """
    if codec is None and narrow(x) and world.size > 1:
        return two_level(x, world, None, None, x.numel(), divisor)
    if codec is None or world.size == 1:
        world.allreduce(x)
        x.div_(divisor)
        return None
    out, error = compressed_allreduce(x, world, codec)  # the sum in x's own memory where x needs no padding
    if out.data_ptr() != x.data_ptr():
        x.copy_(out)
    x.div_(divisor)
    return [(0, error)]


def two_level(
    x: torch.Tensor, row: Comm, col: Optional[Comm], codec: Optional[Codec], chunk_numel: int, divisor: int
) -> Optional[Pieces]:
    """Reduce-scatter along the row, allreduce each slice along the column, all-gather along the row.

    With rows = nodes (``hierarchical``, or ``torus2d`` with X = ranks per node) only the column stage crosses
    nodes, and every local rank runs it on its own 1/L slice, in parallel: a node sends 2(N-1)/N of the bucket
    in total, where a flat ring pushes 2(P-1)/P of it through one rank's link. Only the column stage is
    compressed.

    The tensor goes through in chunks of about ``chunk_numel`` elements, pipelined: while chunk k crosses the
    column (the slow link), the row reduce-scatters chunk k+1 and all-gathers an earlier chunk. Row and column are
    different process groups, so their collectives run side by side. Chunk k's all-gather writes over chunk k of
    the input, which its reduce-scatter has finished reading; chunk k+1, being read, is elsewhere. A compressed
    column stage is pipelined in its turn (:class:`CompressedAllreduce`'s phases): the codec works on one chunk
    while the bytes of the two before it are on the column's wire.

    Sums are fp32 whatever the tensor's dtype: a bf16 tensor crosses the row in bf16, its slices are summed
    and cross the column in fp32 (a partial sum in bf16 would be rounded), and the all-gather rounds the final
    average to bf16 once. ``col=None``: no column stage (:func:`flat` of a bf16 tensor).
    """
    n = x.numel()
    sizes = chunk_sizes(n, row.size, chunk_numel)
    work = x if sum(sizes) == n else F.pad(x, (0, sum(sizes) - n))
    stages = _Stages(work.split(sizes), row, col, codec, divisor)
    for k, mine in stages.reduce_scatter():
        stages.column(k, mine)
    stages.drain()
    if work is not x:
        x.copy_(work[:n])
    return stages.error


class _Stages:
    """One two-level reduction's chunks on their way through the stages: the row's reduce-scatter, the column's
    allreduce (compressed: pipelined in its turn) and the row's all-gather, each issued in chunk order."""

    def __init__(self, chunks: tuple[torch.Tensor, ...], row: Comm, col: Optional[Comm], codec: Optional[Codec],
                 divisor: int) -> None:
        self.chunks, self.row, self.col, self.codec, self.divisor = chunks, row, col, codec, divisor
        self.starts = [sum(c.numel() for c in chunks[:k]) for k in range(len(chunks))]
        #: what this rank's encodings lost (compressing a column of several ranks), else None
        self.error: Optional[Pieces] = [] if codec is not None and col is not None and col.size > 1 else None
        self.gathers: list = []  # running all-gathers
        self.slices: list[torch.Tensor] = []  # ... and the slices they send (alive until waited)
        self.sent: list[tuple[int, CompressedAllreduce]] = []  # compressed column stages whose all-to-all is running
        self.summed: list[tuple[int, CompressedAllreduce]] = []  # ... and those whose all-gather is running

    def reduce_scatter(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Each chunk's slice of the row's sum, in order; chunk k+1's reduce-scatter is started before chunk k is
        handed on, so it runs while chunk k crosses the column."""
        started = self.row.reduce_scatter_start(self.chunks[0])
        for k in range(len(self.chunks)):
            mine = self.row.reduce_scatter_finish(started)
            if k + 1 < len(self.chunks):
                started = self.row.reduce_scatter_start(self.chunks[k + 1])
            yield k, mine

    def column(self, k: int, mine: torch.Tensor) -> None:
        """Chunk k's slice across the column: summed at once, or, compressed, pipelined: chunk k is encoded while
        chunk k-1's all-to-all is on the wire, and chunk k-1 is summed and re-encoded while chunk k-2's all-gather
        is."""
        if self.error is None:
            if self.col is not None:
                self.col.allreduce(mine)
            self._gather(k, mine)
            return
        self.sent.append((k, CompressedAllreduce(mine, self.col, self.codec)))
        if len(self.sent) == 2:
            self.summed.append(self.sent.pop(0))
            self.summed[-1][1].exchange()
        if len(self.summed) == 2:
            self._finish(*self.summed.pop(0))

    def drain(self) -> None:
        """The compressed column stages still under way, in order, then every all-gather waited for."""
        for _, op in self.sent:
            op.exchange()
        for k, op in self.summed + self.sent:
            self._finish(k, op)
        for pending in self.gathers:
            if pending is not None:
                pending.wait()

    def _finish(self, k: int, op: CompressedAllreduce) -> None:
        mine, slice_error = op.finish()
        self.error.append((self.starts[k] + self.row.index * mine.numel(), slice_error))
        self._gather(k, mine)

    def _gather(self, k: int, mine: torch.Tensor) -> None:
        """Chunk k's slice of the world's sum: averaged, then all-gathered along the row into chunk k."""
        mine.div_(self.divisor)
        self.slices.append(mine)
        self.gathers.append(self.row.all_gather(self.chunks[k], mine, async_op=True))
