"""Will training fit in memory? HorizonStrategy's check at setup, with sharding or without.

Nothing fits the weights, gradients and optimizer state to the memory (sharding recomputes activations, which it
can shrink; these it cannot): a model whose state alone exceeds what the node can give is OOM-killed at its first
step, or swaps for hours. The strategy checks at setup, when the weights (and any master copies, and DDP's buckets)
are resident and the optimizers exist: the gradients and the optimizer state, which torch allocates at the first
backward and the first step, are estimated from the module and its optimizers (``estimate.py``) and compared with
this rank's share of the node's free memory (the probe of ``probe.py``, ``HORIZON_AVAILABLE_MEMORY`` included).
Activations come on top and are not estimated: planning them is what sharding does. A sharding budget given in
bytes must be one the rank can have (its resident memory plus its share of the free memory): a plan made for
memory that is not there would not keep the run from running out of it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor
from torch.nn import Module

from lightning_horizon.memory.estimate import gradients_pending, held_bytes, optimizer_state_pending
from lightning_horizon.memory.probe import AVAILABLE_MEMORY_ENV, current_rss, fmt_bytes, node_free_memory


class InsufficientMemoryError(MemoryError):
    """Training cannot fit: raised at setup, on every rank, before the first step."""


def training_memory(
    module: Module, optimizers: list[Any], precision: Any = None, owns: Optional[Callable[[Tensor], bool]] = None,
    weights_shared_by: int = 1,
) -> dict[str, int]:
    """Bytes for the parameters (resident now, master copies included), and estimates of the gradients and the
    optimizer state still to be allocated; ``pending`` is the sum of the last two.

    Under node-sharded state (``owns``: the parameters this rank keeps gradients and state for) the weights are one
    copy per node, ``weights_shared_by`` ranks: this rank's share is counted."""
    held = held_bytes(module, optimizers, precision)
    grads = gradients_pending(optimizers, owns)
    state = optimizer_state_pending(optimizers, owns, getattr(precision, "training_state", None))
    return {"parameters": held["weights"] // weights_shared_by + held["master"], "gradients": grads,
            "optimizer_state": state, "pending": grads + state}


def rank_row(rank: int, node: int, local_world_size: int, need: dict[str, int], sharding: bool = False,
             budget: Optional[int] = None) -> dict[str, Any]:
    """What one rank needs and has, for :func:`check_fit`. ``sharding``: whether activations are planned to a budget;
    ``budget``: its bytes when given in bytes (``ShardingConfig.budget_bytes``)."""
    free = node_free_memory()
    return {"rank": rank, "node": node, "free": free, "available": free // local_world_size,
            "local_world_size": local_world_size, "resident": current_rss(), "sharding": sharding, "budget": budget,
            **need}


def check_fit(rows: list[dict[str, Any]]) -> None:
    """Raise :class:`InsufficientMemoryError` naming the first rank whose estimate exceeds its share; else
    ``ValueError`` naming the first rank whose byte budget exceeds what it can have."""
    short: Optional[dict[str, Any]] = next((r for r in rows if r["pending"] > r["available"]), None)
    if short is not None:
        r = short
        total = r["parameters"] + r["pending"]
        what = ("cannot train this model, even with sharding" if r["sharding"]
                else "cannot train this model without sharding")
        why = ("sharding recomputes activations but cannot shrink these" if r["sharding"]
               else "sharding='auto' recomputes activations to fit but cannot shrink these")
        raise InsufficientMemoryError(
            f"HorizonStrategy: rank {r['rank']} (node {r['node']}) {what}: it needs an estimated {fmt_bytes(total)}"
            f" (parameters {fmt_bytes(r['parameters'])} + gradients {fmt_bytes(r['gradients'])} + optimizer state"
            f" {fmt_bytes(r['optimizer_state'])}), of which {fmt_bytes(r['pending'])} is still to be allocated, but"
            f" {fmt_bytes(r['available'])} is available to it ({_free(r)}), and activations come on top. Options:"
            " fewer ranks per node, HorizonPrecision('bf16-true') (half the weight bytes), a smaller model or more"
            f" memory; {why}."
        )
    over = next((r for r in rows if r["budget"] is not None and r["budget"] > r["resident"] + r["available"]), None)
    if over is not None:
        r, can = over, over["resident"] + over["available"]
        raise ValueError(
            f"ShardingConfig(budget={r['budget']!r}): {fmt_bytes(r['budget'])} is more than rank {r['rank']} (node"
            f" {r['node']}) can have: {fmt_bytes(can)} (resident {fmt_bytes(r['resident'])} +"
            f" {fmt_bytes(r['available'])} available: {_free(r)}); allowed is an int <= {can} bytes, a fraction"
            " (e.g. budget=0.9) or None (auto)"
        )


def _free(row: dict[str, Any]) -> str:
    return (f"{fmt_bytes(row['free'])} free on the node / {row['local_world_size']} rank(s); {AVAILABLE_MEMORY_ENV}"
            " overrides the probe")


__all__ = ["InsufficientMemoryError", "check_fit", "rank_row", "training_memory"]
