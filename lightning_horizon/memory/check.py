"""Will training fit in memory? HorizonStrategy's check at setup when sharding is off.

Without sharding nothing fits the step to the memory: a model whose weights, gradients and optimizer state alone
exceed what the node can give is OOM-killed at its first step, or swaps for hours. The strategy checks at setup,
when the weights (and any master copies, and DDP's buckets) are resident and the optimizers exist: the gradients
and the optimizer state, which torch allocates at the first backward and the first step, are estimated from the
module and its optimizers (``estimate.py``) and compared with this rank's share of the node's free memory (the
probe of ``probe.py``, ``HORIZON_AVAILABLE_MEMORY`` included). Activations come on top and are not estimated:
planning them is what sharding does.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor
from torch.nn import Module

from lightning_horizon.memory.estimate import gradients_pending, held_bytes, optimizer_state_pending
from lightning_horizon.memory.probe import AVAILABLE_MEMORY_ENV, fmt_bytes, node_free_memory


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
    state = optimizer_state_pending(optimizers, owns)
    return {"parameters": held["weights"] // weights_shared_by + held["master"], "gradients": grads,
            "optimizer_state": state, "pending": grads + state}


def rank_row(rank: int, node: int, local_world_size: int, need: dict[str, int]) -> dict[str, Any]:
    """What one rank needs and has, for :func:`check_fit`."""
    free = node_free_memory()
    return {"rank": rank, "node": node, "free": free, "available": free // local_world_size,
            "local_world_size": local_world_size, **need}


def check_fit(rows: list[dict[str, Any]]) -> None:
    """Raise :class:`InsufficientMemoryError` naming the first rank whose estimate exceeds its share."""
    short: Optional[dict[str, Any]] = next((r for r in rows if r["pending"] > r["available"]), None)
    if short is None:
        return
    r = short
    total = r["parameters"] + r["pending"]
    raise InsufficientMemoryError(
        f"HorizonStrategy: rank {r['rank']} (node {r['node']}) cannot train this model without sharding: it needs"
        f" an estimated {fmt_bytes(total)} (parameters {fmt_bytes(r['parameters'])} + gradients"
        f" {fmt_bytes(r['gradients'])} + optimizer state {fmt_bytes(r['optimizer_state'])}), of which"
        f" {fmt_bytes(r['pending'])} is still to be allocated, but {fmt_bytes(r['available'])} is available to it"
        f" ({fmt_bytes(r['free'])} free on the node / {r['local_world_size']} rank(s); {AVAILABLE_MEMORY_ENV}"
        " overrides the probe), and activations come on top. Options: fewer ranks per node,"
        " HorizonPrecision('bf16-true') (half the weight bytes), a smaller model or more memory; sharding='auto'"
        " recomputes activations to fit but cannot shrink these."
    )


__all__ = ["InsufficientMemoryError", "check_fit", "rank_row", "training_memory"]
