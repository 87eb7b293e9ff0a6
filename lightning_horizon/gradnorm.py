"""The global gradient norm, computed in fp32 whatever the gradients' dtype, and clipping by it.

One function serves HorizonPrecision's clipping and GradNormBackoff, so both see the same number. Each is one
foreach op over the gradients that are in memory together (all of them, or one layer's out of core), as
``clip_grad_norm_`` does: the same values, bit for bit, as one op per gradient, without a Python call per gradient.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor


def total_norm_fp32(
    parameters: Iterable[Tensor], norm_type: float = 2.0, group: Optional[dist.ProcessGroup] = None,
    stream: Callable[[list[Tensor]], Iterable[list[Tensor]]] = lambda ps: [ps],
) -> Tensor:
    """The ``norm_type`` norm over all gradients of ``parameters``, accumulated in fp32 (float64 for float64
    gradients) as a 0-dim tensor.

    Parameters without a gradient are ignored; with none at all the norm is 0. Non-finite gradients give a
    non-finite norm (nothing is masked), which is what a caller that skips bad steps needs to see.

    ``group``: the gradients are sharded over its ranks (node-sharded state: each rank holds the gradients of the
    parameters it owns). Each rank's share (sum of ``|g|^p``, or the max for the inf-norm) is all-reduced over the
    group, so every rank gets the norm of the whole gradient, the same value on each.

    ``stream`` cuts the parameters into runs that are in memory together (out-of-core: one layer's gradients).
    """
    parameters = list(parameters)
    dtype = torch.float32  # float64 gradients (precision="64-true") keep their own precision
    for p in parameters:  # the parameters' too: a rank holding none of the gradients must sum in the same dtype
        for t in (p, p.grad):
            if t is not None and t.is_floating_point():
                dtype = torch.promote_types(dtype, t.dtype)
    norms: list[Tensor] = []
    for run in stream(parameters):
        grads = [p.grad.detach() for p in run if p.grad is not None]
        if grads:  # each gradient's norm in ``dtype``, bit for bit linalg.vector_norm's
            norms.extend(torch._foreach_norm(grads, norm_type, dtype=dtype))
    local = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros((), dtype=dtype)
    if group is None:
        return local
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    share = local.pow(norm_type)
    dist.all_reduce(share, group=group)
    return share.pow(1.0 / norm_type)


def clip_grads_(parameters: Iterable[Tensor], max_norm: float, total_norm: Tensor,
                stream: Callable[[list[Tensor]], Iterable[list[Tensor]]] = lambda ps: [ps]) -> float:
    """Scale every gradient in place so that the total norm is at most ``max_norm`` (given the measured norm);
    return the factor applied (1.0 when the norm was within ``max_norm``)."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    if float(coef) == 1.0:
        return 1.0  # x * 1.0 == x: nothing to write
    for run in stream(list(parameters)):
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in run:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad.detach())
        for grad_dtype, grads in by_dtype.items():  # the factor in the gradients' dtype, as one mul_ each would take
            torch._foreach_mul_(grads, coef.to(grad_dtype))
    return float(coef)
