"""What GradNormBackoff needs from the strategy and the other ranks: one decision on every rank (the world's norm,
each node's own under local SGD), the error-feedback residuals scaled with a clip, a log line on rank 0. The
strategy's side is read through HorizonStrategy's public accessors (``nodes_diverge``, ``topology``,
``gradient_sync``, ``training_state``); under another strategy they are absent and the world is one node."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor


def scale_error_feedback(trainer: "pl.Trainer", params: list[Tensor], factor: float) -> None:
    """Under compression with error feedback (HorizonStrategy), the clipped gradients' residuals shrink with them."""
    strategy = trainer.strategy
    sync = getattr(strategy, "gradient_sync", None)
    if sync is not None:
        sync.scale_error_feedback([strategy.training_state.parameter_of(p) for p in params], factor)


def node_of(trainer: "pl.Trainer") -> tuple[int, int]:
    """``(this rank's node, nodes)`` when nodes hold different gradients at a step, else ``(0, 1)``.

    That is HorizonStrategy's local SGD (``sync_every > 1``) on several nodes: between parameter averages a
    node's gradients are reduced inside the node only, so each node clips by its own norm.
    """
    strategy = trainer.strategy
    if not getattr(strategy, "nodes_diverge", False):
        return 0, 1
    return strategy.topology.node_rank, strategy.topology.num_nodes


def agree_across_ranks(norm: Tensor, node: int = 0, nodes: int = 1) -> tuple[float, float]:
    """``(world norm, this node's norm)`` as floats that every rank (of the node) holds identically.

    One MAX all-reduce over the world of ``[finite norm, is_nan, is_inf]`` per node, each rank filling its node's
    row (norms are >= 0, so the zeros elsewhere change nothing): a node's row is the MAX over its ranks, and the
    world norm (NaN if any node's is, else the largest) drives the skip/spike decision, identical on every rank.
    DDP has averaged the gradients before this point, so the ranks of a node already agree; the all-reduce makes
    the decision identical by construction, even if a rank's gradients differ (e.g. unsynced parameters).
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return (float(norm),) * 2  # one rank: its norm is the world's (NaN and inf as they are), no packing
    value = norm.detach().double().reshape(())  # float64 holds an fp32 or a float64 norm exactly
    finite = bool(torch.isfinite(value))
    packed = torch.zeros(nodes, 3, dtype=torch.float64)
    packed[node] = torch.tensor([value.item() if finite else 0.0, float(bool(torch.isnan(value))),
                                 float(bool(torch.isinf(value)))], dtype=torch.float64)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    norms = [float("nan") if is_nan else float("inf") if is_inf else v for v, is_nan, is_inf in packed.tolist()]
    world = float("nan") if any(math.isnan(n) for n in norms) else max(norms)
    return world, norms[node]


def rank_zero(trainer: "pl.Trainer", fn: Any, *args: Any) -> None:
    """``fn(*args)`` on global rank 0 only (a log line once per decision)."""
    if getattr(trainer, "is_global_zero", True):
        fn(*args)


__all__ = ["agree_across_ranks", "node_of", "rank_zero", "scale_error_feedback"]
