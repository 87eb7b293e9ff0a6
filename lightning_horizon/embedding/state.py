"""The state of a table whose rows are spread over the ranks: its state dict and its sparse optimizer's state.

``state_dict()`` holds the whole table under ``weight``, as ``nn.EmbeddingBag`` (a checkpoint loads into one with
``strict=True``): on a placed table it is collective, as FSDP's full state dict (every rank calls it, as
Lightning's checkpointing does), and the whole table is on rank 0 only; the others hold their own rows.
``load_state_dict`` takes the whole table and keeps this rank's rows. The optimizer state goes the same way
(:meth:`TableState.full_optimizer_state`, :meth:`TableState.load_full_optimizer_state`). A table on disk gathers
its whole table into a memory-mapped file on rank 0, block by block, never whole in memory.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_horizon.embedding import exchange
from lightning_horizon.embedding.rows import BLOCK


class TableState:
    """The state dict and the optimizer state of a :class:`~lightning_horizon.embedding.ShardedEmbeddingBag`, a
    base of it (before ``nn.Module``, whose ``_save_to_state_dict`` it extends): the rows, their placement and their
    files are the table's (``weight``, ``rows``, ``bounds``, ``rank``, ``group``, ``replicas``, ``disk``); the table
    registers :meth:`_keep_own_rows` as its load-state-dict pre-hook."""

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        self._ensure_drawn()
        if self.disk is not None:  # the whole table, memory-mapped on rank 0: never in memory at once
            full = self._gather_file("weight") if self.replicas is None or self.replicas[0] == 0 else None
            destination[prefix + "weight"] = full if full is not None else self.weight.detach()
            return
        if self.world == 1 or (self.replicas is not None and self.replicas[0] > 0):  # whole here, or node 0's
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        full = exchange.gather_rows(self.weight.detach(), self.bounds, self.group, self.rank)
        destination[prefix + "weight"] = full if full is not None else self.weight.detach()

    def _keep_own_rows(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        weight = state_dict.get(prefix + "weight")
        if self.rows_on_disk is not None and weight is not None and weight.shape[0] == self.num_embeddings:
            self._load_files({"weight": weight})  # into the files (now, or where they are made)
            state_dict[prefix + "weight"] = self.weight.data  # the Parameter is the cache: nothing to copy
            return
        if weight is not None and not self._drawn:  # the loaded rows replace the drawn ones: none need drawing
            lo, hi = self.rows
            self.weight.data = torch.empty(hi - lo, self.embedding_dim, dtype=self.weight.dtype)
            self._drawn = True
        if self.placed and weight is not None and weight.shape[0] == self.num_embeddings:
            lo, hi = self.rows
            state_dict[prefix + "weight"] = weight[lo:hi]

    def _ensure_state(self) -> None:
        """The sparse optimizer's state of this rank's rows, made (zeros) where the first step has not yet."""
        if not self.optimizer_state:
            lo, hi = self.rows
            self.optimizer_state = self.optimizer.init_state(hi - lo, self.embedding_dim, self.weight.dtype)

    def optimizer_state_bytes(self) -> int:
        """Bytes the sparse optimizer's state of this rank's rows takes, or will once the first step creates it."""
        if self.optimizer_state or self.rows_on_disk is not None:  # on disk: the cache's, allocated at placement
            return 0  # allocated already: resident, not to come
        per_row = self.optimizer.init_state(1, self.embedding_dim, self.weight.dtype)
        return (self.rows[1] - self.rows[0]) * sum(t.numel() * t.element_size() for t in per_row.values())

    def full_optimizer_state(self) -> Optional[dict[str, Tensor]]:
        """The optimizer state of every row on rank 0 (``None`` elsewhere); collective on a placed table (under
        span="node": among node 0's ranks)."""
        if self.replicas is not None and self.replicas[0] > 0:
            return None
        if self.disk is not None:
            full = {k: self._gather_file(k) for k in sorted(self.optimizer_state)}
            return full if self.rank == 0 else None
        if self.world == 1:
            return dict(self.optimizer_state)
        self._ensure_state()  # before the first step: zeros, as the first step makes them
        full = {k: exchange.gather_rows(self.optimizer_state[k], self.bounds, self.group, self.rank)
                for k in sorted(self.optimizer_state)}
        return full if self.rank == 0 else None

    def load_full_optimizer_state(self, state: dict[str, Tensor]) -> None:
        """Take this rank's rows of a whole table's optimizer state (from any number of ranks)."""
        if self.rows_on_disk is not None:
            self._load_files(state)
            return
        lo, hi = self.rows
        self.optimizer_state = {k: v[lo:hi].clone().to(self.weight.dtype) for k, v in state.items()}

    def _gather_file(self, name: str) -> Optional[Tensor]:
        """The whole table's ``name`` (its rows or an optimizer state) on rank 0 of the table's group, in a file
        mapped to memory (never whole in memory), block by block from every rank's files (a block no id reached:
        drawn, or zeros for a state, as the table in memory holds it); ``None`` elsewhere. Collective."""
        disk = self.disk
        assert disk is not None
        disk.flush()
        out = None
        if self.rank == 0:
            out = disk.scratch(name, self.num_embeddings)
        for peer, (lo, hi) in enumerate(self.bounds):
            edges = sorted({lo, hi, *range((lo // BLOCK + 1) * BLOCK, hi, BLOCK)}) if hi > lo else []
            for a, b in zip(edges, edges[1:]):  # block by block, in the same order on every rank
                if peer == self.rank:
                    rows = disk.saved_rows(name, a, b)
                    if self.rank != 0:
                        dist.send(rows.contiguous(), group=self.group, group_dst=0)
                    else:
                        out[a:b] = rows
                elif self.rank == 0:
                    dist.recv(out[a:b], group=self.group, group_src=peer)
        return out

    def _load_files(self, whole: dict[str, Tensor]) -> None:
        """This rank's rows of whole-table tensors (the rows, optimizer states) into its files: now where they
        exist, else once they are made (the table's ``_open_disk``)."""
        if self.disk is None:
            self._pending_files.update(whole)
            return
        for name, tensor in whole.items():
            self.disk.load(name, tensor[self.disk.lo:self.disk.hi])


__all__ = ["TableState"]
