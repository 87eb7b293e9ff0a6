"""Embedding tables sharded by rows over the ranks, looked up by exchanging ids and pooled vectors, updated sparsely
(docs/embedding.md).

- bag.py: :class:`ShardedEmbeddingBag`, the module a user puts in a LightningModule;
- sparse_optim.py: the optimizers that step only the touched rows;
- exchange.py: the point-to-point swaps the lookups and checkpoints use;
- span.py: ``span="auto"``'s choice at the first lookup, a table spread over the world or a copy per node;
- part.py: :class:`EmbeddingTables`, the strategy part that places and steps the tables.
"""

from lightning_horizon.embedding.bag import ShardedEmbeddingBag
from lightning_horizon.embedding.part import EmbeddingTables, TableGroups, table_groups, table_owners, tables_of
from lightning_horizon.embedding.sparse_optim import (
    RowWiseAdagrad, RowWiseAdam, SparseAdagrad, SparseOptimizer, SparseSGD,
)

__all__ = ["EmbeddingTables", "RowWiseAdagrad", "RowWiseAdam", "ShardedEmbeddingBag", "SparseAdagrad",
           "SparseOptimizer", "SparseSGD", "TableGroups", "table_groups", "table_owners", "tables_of"]
