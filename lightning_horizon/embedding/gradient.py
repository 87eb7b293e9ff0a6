"""The touched rows' gradient of a table whose rows are spread over the ranks, from backward to the sparse step.

The table's parameter stays in the user's optimizer (so its learning-rate schedule, clipping and GradNormBackoff's
decisions apply), but that optimizer never sees its gradient: each backward's sparse gradient is set aside as it
arrives (:func:`set_aside`), HorizonStrategy takes the touched rows' gradient before the step
(:meth:`TableGradient.take_gradient`, averaged over the ranks as DDP averages the others), counts it in the global
gradient norm and in clipping, and :meth:`TableGradient.sparse_step` updates only those rows with the table's own
:mod:`sparse optimizer <lightning_horizon.embedding.sparse_optim>`, inside the user's optimizer step. No row of the
table, nor its gradient, ever leaves its owner.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from lightning_horizon.embedding import exchange

if TYPE_CHECKING:
    from lightning_horizon.embedding.bag import ShardedEmbeddingBag


class TableGradient:
    """The gradient and the sparse step of a :class:`~lightning_horizon.embedding.ShardedEmbeddingBag`, a base of
    it: the rows, their placement and their optimizer are the table's (``weight``, ``rows``, ``world``, ``copies``,
    ``replicas``, ``disk``, ``optimizer``, ``optimizer_state``); ``_grads`` holds the gradients :func:`set_aside`
    copied, ``_pending`` the taken one (both made by the table's constructor)."""

    def take_gradient(self) -> bool:
        """Move the table's gradient (sparse or dense) out of ``weight.grad``, averaged over the ranks as DDP
        averages the others' (under span="node" summed across the nodes first: collective), so that the user's
        optimizer steps no row; True when there is one."""
        parts, self._grads = self._grads, []
        dense, self.weight.grad = self.weight.grad, None
        if dense is None or dense.is_sparse:  # the sparse ones are in parts, as they came
            dense = None
            if not parts:
                return False
        rows = [self._rows_of(index) for index, _ in parts]  # duplicates not yet summed
        values = [v for _, v in parts]
        if dense is not None:  # a dense gradient (a user's own F.embedding on .weight): its nonzero rows
            nonzero = dense.abs().sum(1).nonzero().squeeze(1)
            rows.append(self._rows_of(nonzero))
            values.append(dense[nonzero])
        if self.disk is not None:
            self.disk.unpin()  # the gradient is in rows now: no slot is referred to
        grad = torch.sparse_coo_tensor(torch.cat(rows).unsqueeze(0), torch.cat(values),
                                       (self.rows[1] - self.rows[0], self.embedding_dim),
                                       check_invariants=False).coalesce()
        rows, values = grad.indices()[0], grad.values()
        if self.replicas is not None:
            rows, values = exchange.sum_rows(rows, values, self.replicas[2], self.replicas[0], self.replicas[1],
                                             self.meter)
            self.sent_bytes += (self.replicas[1] - 1) * rows.numel() * (8 + values.shape[1] * values.element_size())
        self._pending = (rows, values / (self.world * self.copies))
        return True

    def gradient_share(self, norm_type: float) -> Tensor:
        """This rank's part of the taken gradient's norm: the sum of ``|g|^p`` (the max for the inf-norm)."""
        if self._pending is None or not self._pending[1].numel():
            return torch.zeros((), dtype=torch.promote_types(torch.float32, self.weight.dtype))
        values = self._pending[1].to(torch.promote_types(torch.float32, self.weight.dtype))
        if math.isinf(norm_type):
            return values.abs().max()
        return torch.linalg.vector_norm(values, norm_type).pow(norm_type)

    def scale_gradient(self, factor: Tensor) -> None:
        if self._pending is not None:
            self._pending[1].mul_(factor.to(self._pending[1].dtype))

    def clamp_gradient(self, clip_val: float) -> None:
        if self._pending is not None:
            self._pending[1].clamp_(-clip_val, clip_val)

    def _rows_of(self, index: Tensor) -> Tensor:
        """This rank's rows at ``index`` of ``weight``: the index itself, or on disk the rows its cache slots
        hold."""
        return index if self.disk is None else self.disk.rows_of(index)

    def drop_gradient(self) -> None:
        """Forget the taken gradient: the step touches no row."""
        self._pending = None
        if self.disk is not None:
            self.disk.unpin()

    @torch.no_grad()
    def sparse_step(self, lr: Optional[float] = None) -> None:
        """Update the rows of the taken gradient with the table's optimizer at ``lr`` (``None``: its own)."""
        lr = self.optimizer.lr if lr is None else lr
        if lr is None:
            raise ValueError(f"{type(self).__name__}: optimizer={self.optimizer} takes its parameter group's lr;"
                             " pass sparse_step(lr=...) when stepping it yourself")
        if self._pending is None:
            return
        rows, grad = self._pending
        self._pending = None
        self._ensure_state()
        if self.disk is not None:  # the rows (with span="node", also those other nodes touched) in the cache
            slots = self.disk.ensure(rows, pin=False)
            self.optimizer.step(self.weight.data, self.optimizer_state, slots, grad.to(self.weight.dtype), lr)
            self.disk.mark_dirty(slots)
            self.disk.settle()
            return
        self.optimizer.step(self.weight.data, self.optimizer_state, rows, grad.to(self.weight.dtype), lr)


def set_aside(table: "weakref.ref[ShardedEmbeddingBag]", grad: Tensor) -> Tensor:
    """A backward's gradient of the table's ``weight``, before autograd accumulates it: a sparse one is copied to
    the table's list (a fresh list where ``weight.grad`` was cleared since: ``zero_grad``)."""
    owner = table()
    if owner is not None and grad.is_sparse:
        held = owner.weight.grad
        if held is None or (held.is_sparse and held._nnz() == 0):
            owner._grads = []
        owner._grads.append((grad._indices()[0].clone(), grad._values().clone()))
    return grad


__all__ = ["TableGradient", "set_aside"]
