"""The training state's bytes per rank and per node, replicated against node-sharded: the table at fit start.

Counted per parameter from what each mode stores (weights, master or compensation, gradient, optimizer state;
``memory.estimate.bytes_per_param``), with the optimizer's state tensors (``state_tensors``). Replicated: every rank
holds everything. Node-sharded: the weights once per node; masters, gradients (between steps) and optimizer state of
the parameters a rank owns, on that rank, each shard group of ``group_nodes`` nodes holding one copy of them.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor, nn

from lightning_horizon.memory.estimate import bytes_per_param, state_tensors
from lightning_horizon.memory.probe import fmt_bytes
from lightning_horizon.optim import torch_optimizer


def state_bytes(
    module: nn.Module, optimizers: list[Any], precision: Any, ranks_per_node: int, owner_of: Callable[[Tensor], int],
    weights_shared: bool = True, group_nodes: int = 1,
) -> dict[str, Any]:
    """``{"replicated": {"rank": b, "node": b}, "node_sharded": {"rank": [b per place], "node": b}}``; ``owner_of``
    gives a parameter's owner, a place of the shard group (``0 .. group_nodes x ranks_per_node - 1``); the
    node-sharded weights are one copy per node (``weights_shared``) or one per rank; a node's figure is its most
    loaded node's."""
    mode = getattr(precision, "mode", "fp32")
    master = getattr(precision, "master", None)
    tensors = {}
    for opt in optimizers:
        k = state_tensors(opt)
        for g in torch_optimizer(opt).param_groups:
            for p in g["params"]:
                tensors[p] = k
    per_rank = [0] * (ranks_per_node * group_nodes)
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
    nodes = [sum(per_rank[j * ranks_per_node : (j + 1) * ranks_per_node]) for j in range(group_nodes)]
    return {
        "replicated": {"rank": replicated, "node": replicated * ranks_per_node},
        "node_sharded": {"rank": [weights * copies / ranks_per_node + r for r in per_rank],
                         "node": weights * copies + max(nodes)},
    }


def table(figures: dict[str, Any], ranks_per_node: int, group_nodes: int = 1) -> str:
    rep, sh = figures["replicated"], figures["node_sharded"]
    worst = max(sh["rank"])
    spread = f", the rest sharded over a group of {group_nodes} nodes" if group_nodes > 1 else ""
    return (
        f"HorizonStrategy(state='node_sharded'): training state (weights, masters, gradients, optimizer state)\n"
        f"  replicated:   {fmt_bytes(rep['rank'])} per rank, {fmt_bytes(rep['node'])} per node of {ranks_per_node}\n"
        f"  node_sharded: {fmt_bytes(worst)} per rank (largest share; shared weights counted 1/{ranks_per_node} each"
        f"{spread}), {fmt_bytes(sh['node'])} per node ({sh['node'] / max(rep['node'], 1):.2f}x)"
    )


def at_scale(params: int, weight_bytes: int, state_bytes: int, nodes: int, ranks_per_node: int, group_nodes: int,
             sum_bytes: int = 4) -> dict[str, float]:
    """The model of node-sharded state at scale, per node, on ``nodes`` nodes in shard groups of ``group_nodes``
    (k), for ``params`` parameters of ``weight_bytes`` each: ``state``, the bytes a node holds (the weights once
    plus its 1/k of ``state_bytes`` per parameter: masters, gradients, optimizer state), ``per_rank`` the same over
    ``ranks_per_node``, and ``sent``, the bytes a node sends to other nodes per step, on average over the group.
    Gradients are summed in ``sum_bytes`` (fp32: 4; float64: 8). A node sends the sums of the buckets the other
    nodes of its group own ((k-1)/k of the gradient), the owners all-reduce theirs across the G = n/k groups on a
    ring (2 (G-1)/G of their 1/k) and broadcast their updated weights to the k-1 other nodes of the group. With
    k = 1 that is the ring allreduce of the whole gradient, the traffic of state="replicated"."""
    k, groups = group_nodes, nodes // group_nodes
    if nodes < 1 or k < 1 or nodes % k:
        raise ValueError(f"group_nodes={group_nodes!r} must divide nodes={nodes!r}")
    grads = sum_bytes * params
    sent = grads * (k - 1) / k + 2 * (groups - 1) / groups * grads / k + weight_bytes * params * (k - 1) / k
    return {"state": weight_bytes * params + state_bytes * params / k, "sent": sent,
            "per_rank": weight_bytes * params / ranks_per_node + state_bytes * params / (k * ranks_per_node)}


__all__ = ["at_scale", "state_bytes", "table"]
