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
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    work = x if sum(sizes) == n else F.pad(x, (0, sum(sizes) - n))
    pieces = work.split(sizes)
    error: Optional[Pieces] = [] if codec is not None and col is not None and col.size > 1 else None
    gathers, slices = [], []  # running all-gathers, and the slices they send (alive until waited)
    sent: list[tuple[int, CompressedAllreduce]] = []  # compressed column stages whose all-to-all is running
    summed: list[tuple[int, CompressedAllreduce]] = []  # ... and those whose all-gather is running

    def land(k: int, mine: torch.Tensor) -> None:  # chunk k's slice of the world's sum: average, all-gather
        mine.div_(divisor)
        slices.append(mine)
        gathers.append(row.all_gather(pieces[k], mine, async_op=True))

    def finish(k: int, op: CompressedAllreduce) -> None:
        mine, slice_error = op.finish()
        m = mine.numel()
        error.append((starts[k] + row.index * m, slice_error))
        land(k, mine)

    started = row.reduce_scatter_start(pieces[0])
    for k in range(len(sizes)):
        mine = row.reduce_scatter_finish(started)
        if k + 1 < len(sizes):
            started = row.reduce_scatter_start(pieces[k + 1])  # runs while chunk k crosses the column
        if error is not None:
            # The codec is pipelined too: chunk k is encoded while chunk k-1's all-to-all is on the wire, and chunk
            # k-1 is summed and re-encoded while chunk k-2's all-gather is.
            sent.append((k, CompressedAllreduce(mine, col, codec)))
            if len(sent) == 2:
                summed.append(sent.pop(0))
                summed[-1][1].exchange()
            if len(summed) == 2:
                finish(*summed.pop(0))
        else:
            if col is not None:
                col.allreduce(mine)
            land(k, mine)
    for k, op in sent:
        op.exchange()
    for k, op in summed + sent:
        finish(k, op)
    for pending in gathers:
        if pending is not None:
            pending.wait()
    if work is not x:
        x.copy_(work[:n])
    return error
