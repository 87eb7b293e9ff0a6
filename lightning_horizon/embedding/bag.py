"""ShardedEmbeddingBag: an ``nn.EmbeddingBag`` whose rows HorizonStrategy spreads over the ranks, updated sparsely.

Alone (one process, or before a fit places it) it is a plain embedding bag over the whole table. Once placed
(:meth:`ShardedEmbeddingBag.place`, by HorizonStrategy at the start of a fit), rank ``r`` keeps rows
``[r * ceil(N / W), ...)`` (:mod:`~lightning_horizon.embedding.rows`) and a lookup sends every id to the rank that
owns its row, which sums the rows it owns per bag and sends the partial sums back to the batch's rank
(:mod:`~lightning_horizon.embedding.lookup`); backward runs the same way in reverse. What moves per step is the ids
and ``batch x dim`` partial sums per peer, whatever the table's size.

The step: the user's optimizer never sees the table's gradient; HorizonStrategy takes the touched rows' gradient
before the step and :meth:`~lightning_horizon.embedding.gradient.TableGradient.sparse_step` updates only those rows
with the table's own :mod:`sparse optimizer <lightning_horizon.embedding.sparse_optim>`
(:mod:`~lightning_horizon.embedding.gradient`). ``state_dict()`` holds the whole table under ``weight``, as
``nn.EmbeddingBag``; ``load_state_dict`` keeps this rank's rows (:mod:`~lightning_horizon.embedding.state`).

This module holds the table itself: its options, its placement (a move to a copy per node, its rows on disk) and
its forward.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import shutil
import tempfile
import weakref
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_horizon import rehearsal
from lightning_horizon.checks import check_int, check_one_of, is_int, is_number, require
from lightning_horizon.embedding import exchange
from lightning_horizon.embedding.disk import DiskRows
from lightning_horizon.embedding.gradient import TableGradient, set_aside
from lightning_horizon.embedding.lookup import bags_of, lookup_sharded, pool
from lightning_horizon.embedding.rows import BLOCK, default_cache_rows, draw, spread
from lightning_horizon.embedding.sparse_optim import SparseOptimizer, resolve
from lightning_horizon.embedding.state import TableState

MODES = ("sum", "mean")
PLACEMENTS = ("rows", "table")
SPANS = ("auto", "world", "node")

log = logging.getLogger(__name__)


class ShardedEmbeddingBag(TableGradient, TableState, nn.Module):
    """Sums (or means) of embedding rows per bag, with the table's rows sharded over the ranks and updated sparsely.

    Args:
        num_embeddings: rows of the table.
        embedding_dim: the size of each row.
        mode: ``"sum"`` or ``"mean"`` of each bag's rows (``per_sample_weights`` with ``"sum"`` only).
        optimizer: how the touched rows are stepped: ``"rowwise_adagrad"`` (default), ``"adagrad"``,
            ``"rowwise_adam"``, ``"sgd"`` (their default hyperparameters) or an instance from
            :mod:`lightning_horizon.embedding.sparse_optim` (``RowWiseAdagrad(lr=0.05)``).
        dtype: of the table and its optimizer state: ``torch.float32`` or ``torch.float64``; ``None``: torch's
            default dtype.
        init_std: the rows start as draws of a normal distribution with this standard deviation (1.0, as
            ``nn.EmbeddingBag``).
        init_seed: ``None``: the rows are drawn at construction from torch's global generator, as
            ``nn.EmbeddingBag`` draws them. A seed: each block of 65,536 rows from a generator of its own (this seed
            and the block's number), drawn when the table is first used: a placed table draws only its own rows, so
            a table larger than one rank's memory is never whole anywhere.
        placement: ``"rows"``: every rank holds a block of the rows; ``"table"``: one rank holds the whole table
            (the strategy spreads such tables over the ranks, largest first, each to the rank holding the fewest
            bytes of them): for several small tables, whose rows would cost more to spread than to keep together.
        span: the ranks the table is spread over: ``"world"``, or ``"node"``: every node holds a whole copy spread
            over its own ranks, so lookups never leave the node, and the touched rows' gradients are summed across
            the nodes before the step (on a slow inter-node link, when a batch's ids and partial sums would cost
            more to send across than its touched rows' gradients); ``"auto"`` (default): spread over the world,
            then at the first lookup moved to a copy per node where the measured links and that batch's ids
            predict it cheaper and its rows fit (:mod:`~lightning_horizon.embedding.span`). On one node all three
            are the same. A table on disk is not moved: ``"auto"`` keeps it spread over the world.
        rows_on_disk: a folder: each rank keeps its rows and their optimizer state in memory-mapped files there
            (:mod:`~lightning_horizon.embedding.disk`), ``cache_rows`` of them in memory, for a table larger than
            the ranks' memory. Needs ``init_seed`` (a block of rows is drawn the first time an id reaches it).
            The files are removed when the process ends; the folder stays.
        cache_rows: with ``rows_on_disk``: the rows (with their optimizer state) each rank keeps in memory;
            ``None``: a sixteenth of its rows (at least 65,536), at most what a quarter of its share of the node's
            free memory holds.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "sum",
                 optimizer: Union[str, SparseOptimizer] = "rowwise_adagrad",
                 dtype: Optional[torch.dtype] = None, init_std: float = 1.0,
                 init_seed: Optional[int] = None, placement: str = "rows", span: str = "auto",
                 rows_on_disk: Union[None, str, os.PathLike] = None, cache_rows: Optional[int] = None) -> None:
        super().__init__()
        owner = type(self).__name__
        check_int(owner, "num_embeddings", num_embeddings, 1)
        check_int(owner, "embedding_dim", embedding_dim, 1)
        check_one_of(owner, "mode", mode, MODES)
        check_one_of(owner, "dtype", dtype, (None, torch.float32, torch.float64))
        check_one_of(owner, "placement", placement, PLACEMENTS)
        check_one_of(owner, "span", span, SPANS)
        require(is_number(init_std, 0, include_low=True), owner, "init_std", init_std, "a number >= 0")
        require(init_seed is None or (is_int(init_seed, 0) and init_seed < 2**38), owner, "init_seed", init_seed,
                "None or an int in [0, 2**38)")
        require(rows_on_disk is None or isinstance(rows_on_disk, (str, os.PathLike)), owner, "rows_on_disk",
                rows_on_disk, "None or a folder (str or os.PathLike)")
        require(rows_on_disk is None or init_seed is not None, owner, "rows_on_disk", rows_on_disk,
                "a folder together with an init_seed (the rows are drawn where they are first used, never whole)")
        require(cache_rows is None or (is_int(cache_rows, 1) and rows_on_disk is not None), owner, "cache_rows",
                cache_rows, "None, or an int >= 1 together with rows_on_disk")
        self.num_embeddings, self.embedding_dim, self.mode = num_embeddings, embedding_dim, mode
        self.optimizer = resolve(optimizer, owner)
        self.init_std, self.init_seed, self.placement, self.span = float(init_std), init_seed, placement, span
        self.rows_on_disk = None if rows_on_disk is None else os.fspath(rows_on_disk)
        self.cache_rows = cache_rows
        #: with rows_on_disk: this rank's rows, their files and their cache (made where the rows are first needed)
        self.disk: Optional[DiskRows] = None
        self._pending_files: dict[str, Tensor] = {}  # loaded whole-table tensors, for the files once they exist
        #: span="node" over several nodes: (this node, the nodes, the group of this local rank on every node)
        self.replicas: Optional[tuple[int, int, Any]] = None
        self.owner: Optional[int] = None  # placement="table": the rank that holds the table once placed
        #: span="auto" on several nodes, placed over the world: the choice the first lookup makes (span.py)
        self.span_choice: Optional[Any] = None
        # a seeded table holds no row until first used (_drawn); .to(), .double() apply to the empty tensor alike
        self.weight = nn.Parameter(torch.empty(num_embeddings if init_seed is None else 0, embedding_dim,
                                               dtype=dtype))
        self._drawn = init_seed is None
        if self._drawn:
            nn.init.normal_(self.weight, std=self.init_std)  # as nn.EmbeddingBag
        #: the sparse optimizer's per-row state of the rows this rank holds (created at the first step)
        self.optimizer_state: dict[str, Tensor] = {}
        self.rank, self.world, self.group = 0, 1, None
        self._pending: Optional[tuple[Tensor, Tensor]] = None  # (rows, their gradient), taken before the step
        #: bytes this rank has sent for lookups (ids, partial sums and, where autograd records, their gradients)
        self.sent_bytes = 0
        #: seconds and messages of those exchanges (and of span="node"'s gradient sums)
        self.meter = exchange.Meter()
        self._register_load_state_dict_pre_hook(self._keep_own_rows)
        #: each backward's sparse gradient of ``weight`` since the last step, copied as it arrives (``weight.grad``
        #: accumulates as usual): autograd adds them in an order that follows their indices, which a table on disk
        #: numbers by cache slot; the step sums these in the order they came, the same bits wherever the rows are
        self._grads: list[tuple[Tensor, Tensor]] = []
        self.weight.register_hook(functools.partial(set_aside, weakref.ref(self)))

    # ------------------------------------------------------------------ placement

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """The rows ``[lo, hi)`` each rank holds."""
        return spread(self.num_embeddings, self.world, self.owner)

    @property
    def rows(self) -> tuple[int, int]:
        """The rows ``[lo, hi)`` this rank holds."""
        return self.bounds[self.rank]

    @property
    def placed(self) -> bool:
        return self.world > 1 or self.replicas is not None

    @property
    def copies(self) -> int:
        """How many copies of the table there are (one per node under span="node")."""
        return self.replicas[1] if self.replicas is not None else 1

    @property
    def copy_group(self) -> Any:
        """The process group of the ranks that hold one copy of the rows (``None``: this rank alone)."""
        return self.group

    def place(self, rank: int, world: int, group: Any, owner: Optional[int] = None,
              replicas: Optional[tuple[int, int, Any]] = None, choice: Optional[Any] = None) -> None:
        """Keep rows ``bounds[rank]`` of the table (and of its optimizer state) and look up the others over
        ``group`` (every rank, each calling this with its own rank); ``owner``: the rank that holds a
        ``placement="table"`` table; ``replicas``: under ``span="node"`` on several nodes, (this node, the nodes,
        the group of this rank's place on every node), ``rank``, ``world`` and ``group`` being the node's;
        ``choice``: under ``span="auto"`` on several nodes, placed over the world, the
        :class:`~lightning_horizon.embedding.span.SpanChoice` the first lookup makes. A table already placed
        alike stays (a copy per node that ``"auto"`` chose, too)."""
        if self.span_choice is None and choice is not None and self.replicas is not None:
            return  # span="auto" chose a copy per node in an earlier fit: it stays
        self.span_choice = choice
        if (rank, world, owner) == (self.rank, self.world, self.owner) and (replicas is None) == (
                self.replicas is None):
            self.group, self.replicas = group, replicas
            return
        if self.placed:
            raise RuntimeError(f"{type(self).__name__} is placed on {self.world} ranks; it cannot move to {world}")
        if (owner is None) != (self.placement == "rows"):
            raise ValueError(f"{type(self).__name__}(placement={self.placement!r}): owner={owner!r}")
        self.rank, self.world, self.group, self.owner, self.replicas = rank, world, group, owner, replicas
        lo, hi = self.rows
        if self.rows_on_disk is not None:  # nothing drawn yet: the files get the rows where they are first used
            self._open_disk()
            return
        # .data keeps the Parameter (the optimizer's reference) and frees the other rows
        self.weight.data = self.weight.data[lo:hi].clone() if self._drawn else self._draw(lo, hi)
        self._drawn = True
        self.optimizer_state = {k: v[lo:hi].clone() for k, v in self.optimizer_state.items()}

    def move(self, rank: int, world: int, group: Any, owner: Optional[int], replicas: tuple[int, int, Any],
             holds: list[tuple[int, int]]) -> None:
        """From a placement over the world to a copy per node (``rank``, ``world``, ``group``, ``owner`` and
        ``replicas`` as :meth:`place` takes them), the rows and their optimizer state sent where they go
        (collective over the world's table group; ``holds``: the rows each of the world's ranks holds after)."""
        before, here = self.bounds, self.rank
        if self._drawn:
            self.weight.data = exchange.move_rows(self.weight.data, before, holds, self.group, here)
        self.optimizer_state = {k: exchange.move_rows(v, before, holds, self.group, here)
                                for k, v in sorted(self.optimizer_state.items())}
        self.rank, self.world, self.group, self.owner, self.replicas = rank, world, group, owner, replicas

    def _draw(self, lo: int, hi: int) -> Tensor:
        """Rows ``[lo, hi)`` of a seeded table (:func:`~lightning_horizon.embedding.rows.draw`: the same rows
        whoever draws them)."""
        return draw(self.init_seed, self.init_std, self.num_embeddings, self.embedding_dim, self.weight.dtype, lo, hi)

    def _ensure_drawn(self) -> None:
        if self.rows_on_disk is not None:
            if self.disk is None:
                self._open_disk()
        elif not self._drawn:
            self.weight.data = self._draw(*self.rows)
            self._drawn = True

    def _open_disk(self) -> None:
        """This rank's rows in files of a folder of their own under ``rows_on_disk``; the Parameter holds the
        cache (the optimizer's reference stays), the optimizer state lives in the cache too."""
        lo, hi = self.rows
        os.makedirs(self.rows_on_disk, exist_ok=True)
        folder = tempfile.mkdtemp(prefix=f"table-rank{self.rank}-", dir=self.rows_on_disk)
        atexit.register(shutil.rmtree, folder, True)
        one = self.optimizer.init_state(1, self.embedding_dim, self.weight.dtype)
        cache = self.cache_rows or default_cache_rows(hi - lo, self.embedding_dim, self.weight.element_size(),
                                                      sum(v.numel() * v.element_size() for v in one.values()))
        self.disk = DiskRows(folder, lo, hi, self.embedding_dim, self.weight.dtype,
                             {k: tuple(v.shape[1:]) for k, v in one.items()}, cache, self._draw, BLOCK)
        whole, free = (hi - lo) * self.disk.row_bytes, shutil.disk_usage(folder).free
        if whole > free:  # the files are sparse: they grow as ids reach new blocks; a full disk would end the run
            log.warning(f"{type(self).__name__}(rows_on_disk={self.rows_on_disk!r}): rank {self.rank}'s rows and"
                        f" their optimizer state take up to {whole / 2**30:,.1f} GiB there, {free / 2**30:,.1f} GiB"
                        " is free: the files grow as ids reach new rows, and a full disk ends the run")
        self.weight.data = self.disk.cache["weight"]
        self.optimizer_state = {k: v for k, v in self.disk.cache.items() if k != "weight"}
        self._drawn = True
        pending, self._pending_files = self._pending_files, {}
        self._load_files(pending)

    def _slots(self, local: Tensor) -> Tensor:
        """Where this rank's rows ``local`` are in ``weight``: themselves, or on disk their cache slots (read in,
        and pinned while a gradient will refer to them)."""
        if self.disk is None:
            return local
        if rehearsal.active():  # graph sharding's profile: any slot gives the shapes; the cache must not move
            return torch.zeros_like(local)
        rows, inverse = torch.unique(local, return_inverse=True)
        return self.disk.ensure(rows, pin=torch.is_grad_enabled())[inverse]

    # ------------------------------------------------------------------ forward

    def forward(self, input: Tensor, offsets: Optional[Tensor] = None,
                per_sample_weights: Optional[Tensor] = None) -> Tensor:
        """As ``nn.EmbeddingBag.forward``: ``input`` 2-D (one bag per row) or 1-D with ``offsets`` (each bag's
        start); returns ``[bags, embedding_dim]``."""
        ids, bag, bags = bags_of(input, offsets)
        if self.span_choice is not None and _get_current_dispatch_mode() is None:
            # span="auto": the first lookup decides (collective), then this placement. Not one under a dispatch
            # mode: graph sharding's profile (or a FLOP count) runs a step's forward once more and then undoes what
            # it did to the modules, but a move of the rows would stay
            choice, self.span_choice = self.span_choice, None
            choice.decide(self, ids, bags, per_sample_weights is not None)
        self._ensure_drawn()
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise ValueError(f"{type(self).__name__}(mode={self.mode!r}): per_sample_weights need mode='sum'")
            per_sample_weights = per_sample_weights.reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"{type(self).__name__}: ids must be in [0, {self.num_embeddings}); got"
                             f" [{int(ids.min())}, {int(ids.max())}]")
        if self.world > 1:
            pooled = lookup_sharded(self, ids, bag, bags, per_sample_weights, self._slots)
        else:
            pooled = pool(self.weight, self._slots(ids), bag, bags, per_sample_weights)
        if self.mode == "mean":
            size = torch.bincount(bag, minlength=bags).clamp_(min=1).to(pooled.dtype)
            pooled = pooled / size.unsqueeze(1)
        return pooled

    def extra_repr(self) -> str:
        placed = f", rows={self.rows} of {self.world} ranks" if self.placed else ""
        placed = f", placement={self.placement!r}{placed}" if self.placement != "rows" else placed
        if self.rows_on_disk is not None:
            placed += f", rows_on_disk={self.rows_on_disk!r}"
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r},"
                f" optimizer={self.optimizer}{placed}")


__all__ = ["MODES", "PLACEMENTS", "SPANS", "ShardedEmbeddingBag"]
