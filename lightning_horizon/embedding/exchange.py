"""The wire of a row-sharded table: blocks of rows swapped between every pair of ranks, and a shard gathered whole.

Every exchange is point-to-point (``isend``/``irecv`` with each peer, posted together, then waited on): gloo's
``all_to_all`` ran 3-10x slower than paired sends here. Each runs on the tables' own process group, from one
thread at a time per rank and in the same order on every rank (forward: the ids, then the pooled partial sums;
backward: the partial sums' gradients), so it never interleaves with DDP's gradient allreduce on the default group.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor


class Meter:
    """Seconds a table spent in its exchanges and the messages it posted (forward and backward)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0


def swap_blocks(x: Tensor, send: list[int], recv: list[int], group: Any, rank: int,
                meter: Optional[Meter] = None) -> Tensor:
    """``x`` cut along dim 0 into ``len(send)`` blocks of ``send[i]`` rows, block ``i`` sent to rank ``i``;
    returns the blocks received, ``recv[i]`` rows from rank ``i``, concatenated in rank order (this rank's own
    block is copied, not sent); ``meter`` counts the time and the messages."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    outs = list(out.split(recv))
    ins = list(x.split(send))
    ops = []
    for peer in range(len(send)):
        if peer == rank:
            outs[peer].copy_(ins[peer])
            continue
        if recv[peer]:
            ops.append(dist.P2POp(dist.irecv, outs[peer], group=group, group_peer=peer))
        if send[peer]:
            ops.append(dist.P2POp(dist.isend, ins[peer].contiguous(), group=group, group_peer=peer))
    if ops:
        start = time.perf_counter()
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if meter is not None:
            meter.seconds += time.perf_counter() - start
            meter.calls += len(ops)
    return out


def swap_counts(counts: Tensor, group: Any, rank: int, meter: Optional[Meter] = None) -> Tensor:
    """Each rank's ``counts`` ``[world, k]`` (row ``i``: what it sends to rank ``i``) swapped: row ``i`` of the
    result is what rank ``i`` sends to this one."""
    ones = [1] * counts.shape[0]
    return swap_blocks(counts, ones, ones, group, rank, meter)


class SwapBlocks(torch.autograd.Function):
    """:func:`swap_blocks` with its gradient: the received blocks' gradients go back the way they came."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, send: list[int], recv: list[int], group: Any, rank: int,
                meter: Optional[Meter] = None) -> Tensor:
        ctx.route = (send, recv, group, rank, meter)
        return swap_blocks(x, send, recv, group, rank, meter)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        send, recv, group, rank, meter = ctx.route
        return swap_blocks(grad, recv, send, group, rank, meter), None, None, None, None, None


def sum_rows(rows: Tensor, values: Tensor, group: Any, index: int, count: int,
             meter: Optional[Meter] = None) -> tuple[Tensor, Tensor]:
    """The sum over ``count`` ranks of ``group`` (this one at ``index``) of their sparse row gradients ``(rows,
    values)``: every rank sends its own to every other and adds them all up in rank order, so each gets the same
    rows and the same bits."""
    sizes = swap_counts(torch.full((count, 1), rows.numel()), group, index, meter)[:, 0].tolist()
    every = [rows.numel()] * count
    rows = swap_blocks(rows.repeat(count), every, sizes, group, index, meter)
    values = swap_blocks(values.repeat(count, 1), every, sizes, group, index, meter)
    unique, inverse = torch.unique(rows, return_inverse=True)
    return unique, values.new_zeros((unique.numel(), values.shape[1])).index_add_(0, inverse, values)


def move_rows(shard: Tensor, before: list[tuple[int, int]], after: list[tuple[int, int]], group: Any,
              rank: int) -> Tensor:
    """This rank's rows ``after[rank]`` of a table whose ranks held ``before[r]`` (``shard``: this rank's): each
    rank sends every peer the rows it held that the peer will hold (rows may go to several ranks)."""
    def common(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
        lo = max(a[0], b[0])
        return lo, max(lo, min(a[1], b[1]))

    lo, (new_lo, new_hi) = before[rank][0], after[rank]
    sent = [common(before[rank], dest) for dest in after]
    got = [common(src, after[rank]) for src in before]
    blocks = swap_blocks(torch.cat([shard[a - lo:b - lo] for a, b in sent]), [b - a for a, b in sent],
                         [b - a for a, b in got], group, rank)
    out = shard.new_empty((new_hi - new_lo, *shard.shape[1:]))
    start = 0
    for a, b in got:  # the blocks arrive in the senders' order; each lands at its rows
        out[a - new_lo:b - new_lo] = blocks[start:start + b - a]
        start += b - a
    return out


def gather_rows(shard: Tensor, bounds: list[tuple[int, int]], group: Any, rank: int) -> Optional[Tensor]:
    """The whole table on rank 0 (``None`` elsewhere) from each rank's rows ``bounds[rank]`` (``shard``)."""
    if rank != 0:
        if shard.shape[0]:
            dist.send(shard.contiguous(), group=group, group_dst=0)
        return None
    full = shard.new_empty((bounds[-1][1], *shard.shape[1:]))
    for peer, (lo, hi) in enumerate(bounds):
        if peer == 0:
            full[lo:hi].copy_(shard)
        elif hi > lo:
            dist.recv(full[lo:hi], group=group, group_src=peer)
    return full


__all__ = ["Meter", "SwapBlocks", "gather_rows", "move_rows", "sum_rows", "swap_blocks", "swap_counts"]
