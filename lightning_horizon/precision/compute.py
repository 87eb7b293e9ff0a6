"""How wide a model's matmuls are, for ``compute="auto"``: bf16 wins over fp32 only from a certain width on.

bf16 compute converts activations and weights on the way in and out of each matmul; on narrow matmuls that work is
not repaid by the faster multiply, and a step in bf16 is slower than in fp32 (measured in docs/precision.md). The
width of a model is the FLOP-weighted smaller side of its weight matrices: every 2-D parameter except an embedding
table's (a lookup, not a matmul) weighs by its size, as its share of a token's matmul FLOPs does.
"""

from __future__ import annotations

from typing import Optional

from torch import nn


def matmul_width(module: nn.Module) -> Optional[float]:
    """The FLOP-weighted width of ``module``'s weight matrices; ``None`` without any (the ISA alone decides)."""
    tables = {id(m.weight) for m in module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    size = weighted = 0
    for p in module.parameters():  # each tensor once, however many modules share it
        if p.dim() == 2 and id(p) not in tables:
            size += p.numel()
            weighted += p.numel() * min(p.shape)
    return weighted / size if size else None


__all__ = ["matmul_width"]
