"""ShardedEmbeddingBag: an ``nn.EmbeddingBag`` whose rows HorizonStrategy spreads over the ranks, updated sparsely.

Alone (one process, or before a fit places it) it is a plain embedding bag over the whole table. Once placed
(:meth:`ShardedEmbeddingBag.place`, by HorizonStrategy at the start of a fit), rank ``r`` keeps rows
``[r * ceil(N / W), ...)`` and a lookup goes:

1. every id goes to the rank that owns its row (the ids and their bag numbers, swapped with every peer);
2. each owner sums the rows it owns per bag (a partial pooled vector per bag of each peer's batch);
3. the partial sums go back to the batch's rank, which adds them up (and divides by the bag's size, ``mean``).

Backward runs the same way in reverse: a bag's gradient goes to every owner, which accumulates it into its own
rows as a sparse gradient; no row of the table, nor its gradient, ever leaves its owner. What moves per step is
the ids and ``batch x dim`` partial sums per peer, whatever the table's size.

The step: the table's parameter stays in the user's optimizer (so its learning-rate schedule, clipping and
GradNormBackoff's decisions apply), but that optimizer never sees its gradient: HorizonStrategy takes the touched
rows' gradient before the step (:meth:`take_gradient`, averaged over the ranks as DDP averages the others), counts
it in the global gradient norm and in clipping, and :meth:`sparse_step` updates only those rows with the table's
own :mod:`sparse optimizer <lightning_horizon.embedding.sparse_optim>`, inside the user's optimizer step.

``state_dict()`` holds the whole table under ``weight``, as ``nn.EmbeddingBag`` (a checkpoint loads into one with
``strict=True``): on a placed table it is collective, as FSDP's full state dict (every rank calls it, as
Lightning's checkpointing does), and the whole table is on rank 0 only; the others hold their own rows.
``load_state_dict`` takes the whole table and keeps this rank's rows.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import shutil
import tempfile
import weakref
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_horizon import rehearsal
from lightning_horizon.checks import check_int, check_one_of, is_int, is_number, require
from lightning_horizon.embedding import exchange
from lightning_horizon.embedding.disk import DiskRows
from lightning_horizon.embedding.sparse_optim import SparseOptimizer, resolve
from lightning_horizon.memory.probe import node_free_memory

MODES = ("sum", "mean")
PLACEMENTS = ("rows", "table")
SPANS = ("auto", "world", "node")
BLOCK = 1 << 16  #: rows per generator of a seeded table (init_seed)

log = logging.getLogger(__name__)


class ShardedEmbeddingBag(nn.Module):
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
        self.weight.register_hook(functools.partial(_set_aside, weakref.ref(self)))

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
        """Rows ``[lo, hi)`` of a seeded table: the blocks of :data:`BLOCK` rows that hold them, each from its own
        generator (the same rows whoever draws them)."""
        out = torch.empty(hi - lo, self.embedding_dim, dtype=self.weight.dtype)
        for block in range(lo // BLOCK, -(-hi // BLOCK)):
            start = block * BLOCK
            g = torch.Generator().manual_seed((self.init_seed << 24) + block)
            rows = torch.randn(min(BLOCK, self.num_embeddings - start), self.embedding_dim, generator=g,
                               dtype=self.weight.dtype).mul_(self.init_std)
            a, b = max(lo, start), min(hi, start + rows.shape[0])
            out[a - lo:b - lo] = rows[a - start:b - start]
        return out

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
        ids, bag, bags = _bags(input, offsets)
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
            pooled = self._lookup_sharded(ids, bag, bags, per_sample_weights)
        else:
            pooled = _pool(self.weight, self._slots(ids), bag, bags, per_sample_weights)
        if self.mode == "mean":
            size = torch.bincount(bag, minlength=bags).clamp_(min=1).to(pooled.dtype)
            pooled = pooled / size.unsqueeze(1)
        return pooled

    def _lookup_sharded(self, ids: Tensor, bag: Tensor, bags: int, weights: Optional[Tensor]) -> Tensor:
        starts = torch.tensor([lo for lo, _ in self.bounds])
        owner = torch.searchsorted(starts, ids, right=True) - 1  # the last rank whose rows start at or before
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=self.world)
        # what each peer sends here: its ids' count and its batch's bags
        counts = torch.stack([send, torch.full_like(send, bags)], dim=1)
        got = exchange.swap_counts(counts, self.group, self.rank, self.meter)
        send_n, recv_n, peer_bags = send.tolist(), got[:, 0].tolist(), got[:, 1].tolist()
        columns = [(ids - starts[owner])[order], bag[order]]
        routed = [exchange.swap_blocks(c, send_n, recv_n, self.group, self.rank, self.meter) for c in columns]
        if weights is not None:
            # through autograd: weights that come from parameters get their gradient back from the owners
            columns.append(weights[order].to(self.weight.dtype))
            routed.append(exchange.SwapBlocks.apply(columns[-1], send_n, recv_n, self.group, self.rank, self.meter))
        others = [p for p in range(self.world) if p != self.rank]
        row = self.embedding_dim * self.weight.element_size()
        grads = torch.is_grad_enabled()
        sums = sum(peer_bags[p] for p in others) * row + (len(others) * bags * row if grads else 0)
        weight_grads = (sum(recv_n[p] for p in others) * columns[-1].element_size()
                        if weights is not None and grads and columns[-1].requires_grad else 0)
        self.sent_bytes += (counts[others].numel() * 8 + sum(send_n[p] for p in others)
                            * sum(c.element_size() for c in columns) + sums + weight_grads)
        # the bags of peer p's batch are numbered after those of peers 0..p-1 here
        base = torch.repeat_interleave(torch.tensor([0] + peer_bags[:-1]).cumsum(0), torch.tensor(recv_n))
        partial = _pool(self.weight, self._slots(routed[0]), routed[1] + base, sum(peer_bags),
                        routed[2] if weights is not None else None)
        back = exchange.SwapBlocks.apply(partial, peer_bags, [bags] * self.world, self.group, self.rank, self.meter)
        return back.view(self.world, bags, -1).sum(0)

    # ------------------------------------------------------------------ the step (called by HorizonStrategy)

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

    # ------------------------------------------------------------------ state

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
        exist, else once they are made (:meth:`_open_disk`)."""
        if self.disk is None:
            self._pending_files.update(whole)
            return
        for name, tensor in whole.items():
            self.disk.load(name, tensor[self.disk.lo:self.disk.hi])

    def extra_repr(self) -> str:
        placed = f", rows={self.rows} of {self.world} ranks" if self.placed else ""
        placed = f", placement={self.placement!r}{placed}" if self.placement != "rows" else placed
        if self.rows_on_disk is not None:
            placed += f", rows_on_disk={self.rows_on_disk!r}"
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r},"
                f" optimizer={self.optimizer}{placed}")


def default_cache_rows(rows: int, dim: int, element: int, state_bytes: int) -> int:
    """The rows of a table on disk a rank keeps in memory when ``cache_rows`` is not given: a sixteenth of its
    ``rows`` (at least :data:`BLOCK`), at most what a quarter of its share of the node's free memory holds (one row:
    ``dim`` values of ``element`` bytes and ``state_bytes`` of optimizer state)."""
    share = node_free_memory() // int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) // 4
    return max(1, min(rows, max(BLOCK, rows // 16), share // (dim * element + state_bytes)))


def spread(rows: int, ranks: int, owner: Optional[int] = None) -> list[tuple[int, int]]:
    """The rows ``[lo, hi)`` each of ``ranks`` ranks holds of a table of ``rows`` rows: contiguous blocks of
    ``ceil(rows / ranks)``, or all of them on ``owner`` (the others' empty ranges keep the starts in order)."""
    if owner is not None:
        return [(0, 0) if r < owner else (0, rows) if r == owner else (rows, rows) for r in range(ranks)]
    per = math.ceil(rows / ranks)
    return [(min(r * per, rows), min((r + 1) * per, rows)) for r in range(ranks)]


def _set_aside(table: "weakref.ref[ShardedEmbeddingBag]", grad: Tensor) -> Tensor:
    """A backward's gradient of the table's ``weight``, before autograd accumulates it: a sparse one is copied to
    the table's list (a fresh list where ``weight.grad`` was cleared since: ``zero_grad``)."""
    owner = table()
    if owner is not None and grad.is_sparse:
        held = owner.weight.grad
        if held is None or (held.is_sparse and held._nnz() == 0):
            owner._grads = []
        owner._grads.append((grad._indices()[0].clone(), grad._values().clone()))
    return grad


def _bags(input: Tensor, offsets: Optional[Tensor]) -> tuple[Tensor, Tensor, int]:
    """The ids (1-D), each id's bag number and the number of bags, from ``nn.EmbeddingBag``'s two input forms."""
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError("ShardedEmbeddingBag: offsets must be None with 2-D input (one bag per row)")
        bags, size = input.shape
        return input.reshape(-1), torch.arange(bags).repeat_interleave(size), bags
    if input.dim() != 1 or offsets is None or offsets.dim() != 1:
        raise ValueError("ShardedEmbeddingBag: input is 2-D (bags x ids), or 1-D with 1-D offsets (each bag's start)")
    bags = offsets.numel()
    sizes = torch.diff(offsets, append=torch.tensor([input.numel()], dtype=offsets.dtype))
    return input, torch.arange(bags).repeat_interleave(sizes), bags


def _pool(weight: Tensor, ids: Tensor, bag: Tensor, bags: int, weights: Optional[Tensor]) -> Tensor:
    """Per bag, the sum of the rows ``ids`` (times ``weights``); the gradient reaches ``weight`` as a sparse one."""
    rows = F.embedding(ids, weight, sparse=True)
    if weights is not None:
        rows = rows * weights.unsqueeze(1)
    return rows.new_zeros((bags, weight.shape[1])).index_add(0, bag, rows)


__all__ = ["BLOCK", "MODES", "PLACEMENTS", "SPANS", "ShardedEmbeddingBag", "default_cache_rows", "spread"]
