"""Where a table's rows are: the blocks of rows each rank holds, a seeded table's rows drawn block by block, and the
rows of a table on disk a rank keeps in memory.

A table of ``N`` rows placed on ``W`` ranks gives rank ``r`` the rows ``[r * ceil(N / W), (r + 1) * ceil(N / W))``
(:func:`spread`), or all of them to one rank (``placement="table"``). A seeded table draws each block of
:data:`BLOCK` rows from a generator of its own (:func:`draw`), so a rank draws only its own rows and they are the
same whoever draws them.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch import Tensor

from lightning_horizon.memory.probe import node_free_memory

BLOCK = 1 << 16  #: rows per generator of a seeded table (init_seed)


def spread(rows: int, ranks: int, owner: Optional[int] = None) -> list[tuple[int, int]]:
    """The rows ``[lo, hi)`` each of ``ranks`` ranks holds of a table of ``rows`` rows: contiguous blocks of
    ``ceil(rows / ranks)``, or all of them on ``owner`` (the others' empty ranges keep the starts in order)."""
    if owner is not None:
        return [(0, 0) if r < owner else (0, rows) if r == owner else (rows, rows) for r in range(ranks)]
    per = math.ceil(rows / ranks)
    return [(min(r * per, rows), min((r + 1) * per, rows)) for r in range(ranks)]


def draw(seed: int, std: float, num_embeddings: int, dim: int, dtype: torch.dtype, lo: int, hi: int) -> Tensor:
    """Rows ``[lo, hi)`` of a table of ``num_embeddings`` rows seeded with ``seed``: the blocks of :data:`BLOCK`
    rows that hold them, each from its own generator (normal draws with standard deviation ``std``)."""
    out = torch.empty(hi - lo, dim, dtype=dtype)
    for block in range(lo // BLOCK, -(-hi // BLOCK)):
        start = block * BLOCK
        g = torch.Generator().manual_seed((seed << 24) + block)
        rows = torch.randn(min(BLOCK, num_embeddings - start), dim, generator=g, dtype=dtype).mul_(std)
        a, b = max(lo, start), min(hi, start + rows.shape[0])
        out[a - lo:b - lo] = rows[a - start:b - start]
    return out


def default_cache_rows(rows: int, dim: int, element: int, state_bytes: int) -> int:
    """The rows of a table on disk a rank keeps in memory when ``cache_rows`` is not given: a sixteenth of its
    ``rows`` (at least :data:`BLOCK`), at most what a quarter of its share of the node's free memory holds (one row:
    ``dim`` values of ``element`` bytes and ``state_bytes`` of optimizer state)."""
    share = node_free_memory() // int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) // 4
    return max(1, min(rows, max(BLOCK, rows // 16), share // (dim * element + state_bytes)))


__all__ = ["BLOCK", "default_cache_rows", "draw", "spread"]
