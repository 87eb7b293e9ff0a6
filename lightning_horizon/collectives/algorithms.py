"""The allreduce algorithms, on one flat fp32 tensor: flat, and two-level (hierarchical / 2D torus).

Both return the *sum* over the world (the hook divides) and, when compressing, what this rank's encodings lost
in the tensor's layout (the error feedback's new residual). Each collective blocks before the next is issued,
from the caller's thread: no collective ever runs from a ``Future.then`` callback.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lightning_horizon.collectives.comm import Comm
from lightning_horizon.collectives.compression import Codec, compressed_allreduce
from lightning_horizon.collectives.cost_model import round_up


def flat(x: torch.Tensor, world: Comm, codec: Optional[Codec]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One allreduce over the world (compressed: all-to-all, fp32 sum, all-gather)."""
    if codec is None or world.size == 1:
        return world.allreduce(x), None
    return compressed_allreduce(x, world, codec)


def two_level(
    x: torch.Tensor, row: Comm, col: Comm, codec: Optional[Codec]
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Reduce-scatter along the row, allreduce each slice along the column, all-gather along the row.

    With rows = nodes (``hierarchical``, or ``torus2d`` with X = ranks per node) the column stage is the only
    one that crosses nodes, and every local rank runs it on its own 1/L slice, in parallel: each node sends
    2(N-1)/N of the bucket in total, where a flat ring sends 2(P-1)/P of it through each node's link.
    Only the column stage is compressed.
    """
    n = x.numel()
    padded = F.pad(x, (0, round_up(n, row.size) - n))
    mine = row.reduce_scatter(padded)
    error = None
    if codec is not None and col.size > 1:
        mine, slice_error = compressed_allreduce(mine, col, codec)
        error = torch.zeros_like(padded)
        m = mine.numel()
        error[row.index * m : (row.index + 1) * m] = slice_error
    else:
        col.allreduce(mine)
    out = torch.empty_like(padded)
    row.all_gather(out, mine)
    return out[:n], (error[:n] if error is not None else None)
