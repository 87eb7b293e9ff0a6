"""Optimizers for the rows of an embedding table: only the rows a step's batch touched are read and written.

Each is a small frozen dataclass (its hyperparameters) with two functions: ``init_state`` allocates the per-row
state of a table's rows, ``step`` updates the touched ``rows`` (unique, sorted) of ``weight`` from their
gradients ``grad`` (``[len(rows), dim]``, already averaged over the ranks and clipped) at the step's ``lr``.
Untouched rows, their state and their step counts are never read or written: that is the difference from a dense
optimizer, where every row decays, carries momentum and counts a step on every step.

- :class:`SparseSGD`: ``w -= lr * g``; the same as ``torch.optim.SGD`` (no momentum, no weight decay) on a dense
  table, whose untouched rows get a zero gradient and so do not move either.
- :class:`SparseAdagrad`: ``torch.optim.Adagrad`` on sparse gradients (per-element sum of squares, ``lr_decay=0``):
  the same update, state for state.
- :class:`RowWiseAdagrad`: one accumulator per row (the mean of the squared gradient over the row), as TorchRec /
  FBGEMM's ``ROWWISE_ADAGRAD``: a dim-th of Adagrad's state.
- :class:`RowWiseAdam`: a first moment per element and a second moment per row (the mean over the row, as FBGEMM's
  partial row-wise Adam), each row with its own step count for the bias correction. A row's moments decay only
  when it is touched: a row seen once in a thousand steps keeps its momentum until it is seen again, where dense
  Adam(W) would have decayed it a thousand times (and AdamW's weight decay would have shrunk the row); use
  ``torch.optim.AdamW`` on a dense ``nn.EmbeddingBag`` for that behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from lightning_horizon.checks import is_number, require


@dataclass(frozen=True)
class SparseOptimizer:
    """The base: a learning rate. ``None``: the lr of the user's parameter group that holds the table, at each step
    (its schedule and GradNormBackoff's backoff included: the table steps as that group's parameters would). A
    number: the table's own, multiplied at each step by that group's lr over its ``initial_lr`` (the factor by
    which a scheduler or the backoff moved it; note that OneCycleLR and CyclicLR start from their own base lr)."""

    lr: Optional[float] = 0.01

    def __post_init__(self) -> None:
        require(self.lr is None or is_number(self.lr, 0, include_low=True), type(self).__name__, "lr", self.lr,
                "a number >= 0 or None (the lr of the table's parameter group)")

    def init_state(self, rows: int, dim: int, dtype: torch.dtype) -> dict[str, Tensor]:
        return {}

    def step(self, weight: Tensor, state: dict[str, Tensor], rows: Tensor, grad: Tensor, lr: float) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class SparseSGD(SparseOptimizer):
    """``w[rows] -= lr * g``."""

    def step(self, weight: Tensor, state: dict[str, Tensor], rows: Tensor, grad: Tensor, lr: float) -> None:
        weight.index_add_(0, rows, grad, alpha=-lr)


@dataclass(frozen=True)
class SparseAdagrad(SparseOptimizer):
    """``torch.optim.Adagrad`` (``lr_decay=0``, ``weight_decay=0``, ``initial_accumulator_value=0``) on the touched
    rows: ``sum += g*g``; ``w -= lr * g / (sqrt(sum) + eps)``."""

    eps: float = 1e-10

    def init_state(self, rows: int, dim: int, dtype: torch.dtype) -> dict[str, Tensor]:
        return {"sum": torch.zeros(rows, dim, dtype=dtype)}

    def step(self, weight: Tensor, state: dict[str, Tensor], rows: Tensor, grad: Tensor, lr: float) -> None:
        total = state["sum"].index_add_(0, rows, grad * grad)[rows]
        weight.index_add_(0, rows, grad / total.sqrt_().add_(self.eps), alpha=-lr)


@dataclass(frozen=True)
class RowWiseAdagrad(SparseOptimizer):
    """One accumulator per row: ``acc += mean(g*g)``; ``w -= lr * g / (sqrt(acc) + eps)``."""

    eps: float = 1e-8

    def init_state(self, rows: int, dim: int, dtype: torch.dtype) -> dict[str, Tensor]:
        return {"sum": torch.zeros(rows, dtype=dtype)}

    def step(self, weight: Tensor, state: dict[str, Tensor], rows: Tensor, grad: Tensor, lr: float) -> None:
        acc = state["sum"].index_add_(0, rows, (grad * grad).mean(dim=1))[rows]
        weight.index_add_(0, rows, grad / acc.sqrt_().add_(self.eps).unsqueeze(1), alpha=-lr)


@dataclass(frozen=True)
class RowWiseAdam(SparseOptimizer):
    """A first moment per element, a second moment per row (the mean of ``g*g`` over the row) and a step count per
    row, all updated only when the row is touched::

        t += 1;  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*mean(g*g)
        w -= lr * (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps)
    """

    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        ok = len(self.betas) == 2 and all(is_number(b, 0, 1, include_low=True) for b in self.betas)
        require(ok, "RowWiseAdam", "betas", self.betas, "two numbers in [0, 1)")

    def init_state(self, rows: int, dim: int, dtype: torch.dtype) -> dict[str, Tensor]:
        return {"exp_avg": torch.zeros(rows, dim, dtype=dtype), "exp_avg_sq": torch.zeros(rows, dtype=dtype),
                "step": torch.zeros(rows, dtype=dtype)}

    def step(self, weight: Tensor, state: dict[str, Tensor], rows: Tensor, grad: Tensor, lr: float) -> None:
        b1, b2 = self.betas
        t = state["step"].index_add_(0, rows, torch.ones_like(rows, dtype=grad.dtype))[rows]
        m = state["exp_avg"][rows].mul_(b1).add_(grad, alpha=1 - b1)
        v = state["exp_avg_sq"][rows].mul_(b2).add_((grad * grad).mean(dim=1), alpha=1 - b2)
        state["exp_avg"][rows] = m
        state["exp_avg_sq"][rows] = v
        denom = (v / (1 - b2 ** t)).sqrt_().add_(self.eps)
        update = m / (1 - b1 ** t).unsqueeze(1) / denom.unsqueeze(1)
        weight.index_add_(0, rows, update, alpha=-lr)


#: the names a table's ``optimizer=`` takes for the classes above, with their default hyperparameters
NAMES: dict[str, type[SparseOptimizer]] = {
    "sgd": SparseSGD, "adagrad": SparseAdagrad, "rowwise_adagrad": RowWiseAdagrad, "rowwise_adam": RowWiseAdam,
}


def resolve(optimizer: Union[str, SparseOptimizer], owner: str) -> SparseOptimizer:
    """``optimizer`` as an instance: a name of :data:`NAMES` (its defaults) or an instance given."""
    if isinstance(optimizer, SparseOptimizer):
        return optimizer
    require(optimizer in NAMES, owner, "optimizer", optimizer,
            f"one of {tuple(NAMES)} or an instance of {', '.join(c.__name__ for c in NAMES.values())}")
    return NAMES[optimizer]()


__all__ = ["NAMES", "RowWiseAdagrad", "RowWiseAdam", "SparseAdagrad", "SparseOptimizer", "SparseSGD", "resolve"]
