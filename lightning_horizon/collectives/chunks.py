"""How a reduction cuts and pads a flat tensor, and what its pieces weigh on the wire.

Shared by the algorithms that run (``algorithms.py``, ``compression.py``, ``local_sgd.py``, ``outer.py``), the link
probe and the cost model, so that the model's byte counts are the hooks' byte counts, padding included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

#: bytes per fp32 element
FP32 = 4


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def payload_bytes(numel: int, compression: Optional[str], int8_block: int) -> int:
    """Bytes on the wire for ``numel`` elements (``numel`` a multiple of the block for int8)."""
    if compression is None:
        return FP32 * numel
    if compression == "bf16":
        return 2 * numel
    return numel + FP32 * (numel // int8_block)  # int8 values, then one fp32 scale per block


def chunk_sizes(numel: int, row_size: int, chunk_numel: int) -> list[int]:
    """How a two-level reduction cuts ``numel`` elements: chunks of ``chunk_numel`` rounded up to a multiple of
    the row, the last one shorter and padded to a multiple of the row."""
    padded = round_up(numel, row_size)
    chunk = round_up(max(chunk_numel, 1), row_size)
    full, rest = divmod(padded, chunk)
    return [chunk] * full + ([rest] if rest else [])


def row_slice(flat: "torch.Tensor", rows: int, index: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """``flat`` padded with zeros to a multiple of ``rows``, and slice ``index`` of ``rows`` equal ones of it (a
    view): the piece of a flat tensor one rank of a node works on, the node gathering the pieces back."""
    import torch.nn.functional as F

    padded = F.pad(flat, (0, round_up(flat.numel(), rows) - flat.numel()))
    m = padded.numel() // rows
    return padded, padded[index * m : (index + 1) * m]
