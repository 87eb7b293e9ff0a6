"""The global gradient norm, computed in fp32 whatever the gradients' dtype, and clipping by it.

One function serves HorizonPrecision's clipping and GradNormBackoff, so both see the same number.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor


def total_norm_fp32(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The ``norm_type`` norm over all gradients of ``parameters``, accumulated in fp32 (float64 for float64
    gradients) as a 0-dim tensor.

    Parameters without a gradient are ignored; with none at all the norm is 0. Non-finite gradients give a
    non-finite norm (nothing is masked), which is what a caller that skips bad steps needs to see.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    dtype = torch.float32  # float64 gradients (precision="64-true") keep their own precision
    for g in grads:
        dtype = torch.promote_types(dtype, g.dtype)
    norms = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=dtype) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_grads_(parameters: Iterable[Tensor], max_norm: float, total_norm: Tensor) -> float:
    """Scale every gradient in place so that the total norm is at most ``max_norm`` (given the measured norm);
    return the factor applied (1.0 when the norm was within ``max_norm``)."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in parameters:
        if p.grad is not None:
            p.grad.detach().mul_(coef.to(p.grad.dtype))
    return float(coef)
