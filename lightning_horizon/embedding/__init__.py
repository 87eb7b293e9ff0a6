"""Embedding tables sharded by rows over the ranks, looked up by exchanging ids and pooled vectors, updated sparsely
(docs/embedding.md).

- bag.py: :class:`ShardedEmbeddingBag`, the module a user puts in a LightningModule: its options, placement and
  forward;
- rows.py: the rows each rank holds, a seeded table's rows drawn block by block, a table on disk's cache size;
- lookup.py: a lookup over the ranks, ids out to their rows' owners and partial sums back;
- gradient.py: the touched rows' gradient, set aside in backward, taken before the step, stepped sparsely;
- state.py: the whole table's state dict and optimizer state, and this rank's rows of them on load;
- disk.py: a table's rows in memory-mapped files, the hot rows in a cache;
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
