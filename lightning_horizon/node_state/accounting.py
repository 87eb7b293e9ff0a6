"""The training state's bytes per rank and per node, replicated against node-sharded: the table at fit start.

Counted per parameter from what each mode stores (weights, master or compensation, gradient, optimizer state;
``memory.estimate.bytes_per_param``), with the optimizer's state tensors (``state_tensors``). Replicated: every rank
holds everything. Node-sharded: the weights once per node; masters, gradients (between steps) and optimizer state of
the parameters a rank owns, on that rank.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor, nn

from lightning_horizon.memory.estimate import bytes_per_param, state_tensors
from lightning_horizon.memory.probe import fmt_bytes
from lightning_horizon.optim import torch_optimizer


def state_bytes(
    module: nn.Module, optimizers: list[Any], precision: Any, ranks_per_node: int, owner_of: Callable[[Tensor], int],
    weights_shared: bool = True,
) -> dict[str, Any]:
    """``{"replicated": {"rank": b, "node": b}, "node_sharded": {"rank": [b per local rank], "node": b}}``; the
    node-sharded weights are one copy per node (``weights_shared``) or one per rank."""
    mode = getattr(precision, "mode", "fp32")
    master = getattr(precision, "master", None)
    tensors = {}
    for opt in optimizers:
        k = state_tensors(opt)
        for g in torch_optimizer(opt).param_groups:
            for p in g["params"]:
                tensors[p] = k
    per_rank = [0] * ranks_per_node
    replicated = weights = 0
    for p in dict.fromkeys(module.parameters()):
        b = bytes_per_param(mode, master, tensors.get(p, 0)) if p.requires_grad else {"weights": 4, "total": 4}
        scale = p.numel() * p.element_size() / b["weights"]  # numel, in the weights' own dtype
        w = b["weights"] * scale
        rest = (b["total"] - b["weights"]) * scale if p.requires_grad else 0
        weights += w
        replicated += w + rest
        per_rank[owner_of(p)] += rest
    copies = 1 if weights_shared else ranks_per_node
    return {
        "replicated": {"rank": replicated, "node": replicated * ranks_per_node},
        "node_sharded": {"rank": [weights * copies / ranks_per_node + r for r in per_rank],
                         "node": weights * copies + sum(per_rank)},
    }


def table(figures: dict[str, Any], ranks_per_node: int) -> str:
    rep, sh = figures["replicated"], figures["node_sharded"]
    worst = max(sh["rank"])
    return (
        f"HorizonStrategy(state='node_sharded'): training state (weights, masters, gradients, optimizer state)\n"
        f"  replicated:   {fmt_bytes(rep['rank'])} per rank, {fmt_bytes(rep['node'])} per node of {ranks_per_node}\n"
        f"  node_sharded: {fmt_bytes(worst)} per rank (largest share; shared weights counted 1/{ranks_per_node} each),"
        f" {fmt_bytes(sh['node'])} per node ({sh['node'] / max(rep['node'], 1):.2f}x)"
    )


__all__ = ["state_bytes", "table"]
