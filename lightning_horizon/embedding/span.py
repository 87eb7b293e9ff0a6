"""``span="auto"``: a table spread over the world's ranks, or a copy per node, chosen at its first lookup.

On several nodes HorizonStrategy places a ``span="auto"`` table over the world (the least memory per rank) and
hands it a :class:`SpanChoice`. At the table's first lookup every rank measures what its batch would send either
way (:class:`Traffic`: the ids whose row lives on another rank of its node or on another node, the bags, and, by
one exchange of its distinct ids inside the node, the distinct rows its node touches), the world sums it, and
:func:`predict` prices one step of each layout with the strategy's link constants (``cost_model=``, or the setup
probe's, collective). A copy per node is taken where it is predicted faster and its rows and their optimizer state
fit in half this rank's share of the node's free memory on every rank; the rows and their state then move there
(:meth:`ShardedEmbeddingBag.move`), before that lookup, and the choice is logged once.

The model of one step's exchanges (forward and backward), every message of a phase posted at once, so one latency
per phase on each link class it uses, and a node's ranks sharing its NIC (as in collectives/cost_model.py):

- spread over the world: the ids (their row numbers and bag numbers, and weights) go to their rows' owners, and
  every rank sends every peer the partial sums of the peer's bags forward and its own bags' gradients backward
  (``2 x bags x dim x 4`` bytes per peer); the peers on other nodes cross the NIC;
- a copy per node: the same lookups inside the node only; then each node's distinct touched rows (8 bytes of row
  number and the row's gradient) go to every other node, in three phases (counts, rows, gradients).

The first batch stands for the others: a workload whose ids change their spread later keeps the first choice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_horizon.embedding import exchange
from lightning_horizon.embedding.rows import spread
from lightning_horizon.memory.probe import fair_share, fmt_bytes

log = logging.getLogger(__name__)

ROW_NUMBER = 8  #: bytes of a row number on the wire (int64)


@dataclass(frozen=True)
class Traffic:
    """What one step's lookups of a table touch, summed over the world's ranks."""

    ids: float  #: ids looked up
    bags: float  #: bags (samples)
    remote: float  #: ids whose row is on another node, the table spread over the world
    world_peers: float  #: ids whose row is on another rank of the same node, the table spread over the world
    node_peers: float  #: ids whose row is on another rank of the node, a copy per node
    distinct: float  #: distinct rows each node touches, summed over the nodes


def predict(traffic: Traffic, links: Any, nodes: int, per_node: int, row_bytes: int, id_bytes: int,
            columns: int) -> tuple[float, float]:
    """Seconds of one step's lookup exchanges with the table spread over the world, and with a copy per node (its
    row sums across the nodes included); ``links``: a :class:`~lightning_horizon.collectives.CostModel`,
    ``row_bytes``: a row's, ``id_bytes``: what one id sends (row number, bag number, weight), ``columns``: how many
    tensors carry them."""
    world = nodes * per_node
    phases = 3 + columns  # the counts, each column of the ids, the partial sums, their gradients
    sums = 2 * traffic.bags / world * row_bytes  # to each peer: its bags' partial sums, then this rank's gradients
    intra_alpha = links.intra.alpha if per_node > 1 else 0.0
    over_world = (phases * max(intra_alpha, links.inter.alpha)
                  + (traffic.world_peers / world * id_bytes + (per_node - 1) * sums) * links.intra.beta
                  + per_node * (traffic.remote / world * id_bytes + (world - per_node) * sums) * links.inter.beta)
    rows_out = traffic.distinct / nodes * (ROW_NUMBER + row_bytes) * (nodes - 1)  # a node's, to every other node
    per_node_copy = (phases * intra_alpha
                     + (traffic.node_peers / world * id_bytes + (per_node - 1) * sums) * links.intra.beta
                     + 3 * links.inter.alpha + rows_out * links.inter.beta)
    return over_world, per_node_copy


class SpanChoice:
    """The choice a ``span="auto"`` table makes at its first lookup (collective over the world's ranks).

    Args:
        name: the table's name in the module (for the log line).
        topology: the strategy's (rank, nodes, ranks per node).
        node_layout: the copy-per-node placement, as :meth:`ShardedEmbeddingBag.move` takes it: (this rank's
            place on its node, the node's ranks, their group, the owner of a ``placement="table"`` table,
            (this node, the nodes, the group of this place on every node)).
        links: returns the link constants (a ``CostModel``; collective where it probes).
    """

    def __init__(self, name: str, topology: Any, node_layout: tuple[int, int, Any, Optional[int], Any],
                 links: Callable[[], Any]) -> None:
        self.name, self.topology, self.node_layout, self.links = name, topology, node_layout, links

    def measure(self, table: Any, ids: Tensor, bags: int) -> Tensor:
        """This rank's part of the :class:`Traffic` of its batch (``ids``, in ``bags`` bags), and a last entry: 1
        where a copy per node does not fit here (summed over the world, these are the world's)."""
        t = self.topology
        local, per_node, node_group, owner, _ = self.node_layout
        holder = torch.searchsorted(torch.tensor([lo for lo, _ in table.bounds]), ids, right=True) - 1
        on_node = torch.div(holder, per_node, rounding_mode="floor") == t.node_rank
        node_rows = spread(table.num_embeddings, per_node, owner)
        node_starts = torch.tensor([lo for lo, _ in node_rows])
        # the node's distinct rows: each rank's distinct ids go to their owner on the node, which counts its own
        unique = torch.unique(ids)  # sorted: their owners come in rank order
        send = torch.bincount(torch.searchsorted(node_starts, unique, right=True) - 1, minlength=per_node)
        if per_node > 1:
            recv = exchange.swap_counts(send.unsqueeze(1), node_group, local)[:, 0]
            unique = exchange.swap_blocks(unique, send.tolist(), recv.tolist(), node_group, local)
        node_peers = (torch.searchsorted(node_starts, ids, right=True) - 1 != local).sum()
        fits = self.copy_bytes(table) <= fair_share(per_node) // 2
        return torch.tensor([ids.numel(), bags, int((~on_node).sum()), int((on_node & (holder != t.rank)).sum()),
                             int(node_peers), torch.unique(unique).numel(), 0 if fits else 1], dtype=torch.float64)

    def copy_bytes(self, table: Any, largest: bool = False) -> int:
        """This rank's rows of a copy per node (``largest``: the node's rank holding most) with their optimizer
        state, in bytes."""
        local, per_node, _, owner, _ = self.node_layout
        rows = [hi - lo for lo, hi in spread(table.num_embeddings, per_node, owner)]
        state = table.optimizer.init_state(1, table.embedding_dim, table.weight.dtype)
        per_row = table.embedding_dim * table.weight.element_size() + sum(
            s.numel() * s.element_size() for s in state.values())
        return (max(rows) if largest else rows[local]) * per_row

    def decide(self, table: Any, ids: Tensor, bags: int, weighted: bool) -> bool:
        """Move ``table`` to a copy per node where that is predicted cheaper and fits (collective over the world's
        ranks, at the first lookup: every rank calls it, with its batch's ``ids`` in ``bags`` bags, ``weighted``
        with per-sample weights); True when it moved."""
        sums = self.measure(table, ids, bags)
        dist.all_reduce(sums, group=table.group)
        *counts, misfits = sums.tolist()
        traffic = Traffic(*counts)
        t = self.topology
        row_bytes = table.embedding_dim * table.weight.element_size()
        id_bytes = 2 * ROW_NUMBER + (table.weight.element_size() if weighted else 0)
        spread_s, copies_s = predict(traffic, self.links(), t.num_nodes, t.ranks_per_node, row_bytes, id_bytes,
                                     3 if weighted else 2)
        per_node = copies_s < spread_s and not misfits
        if t.rank == 0:
            fit = "fits" if not misfits else f"does not fit in half the free memory of {int(misfits)} rank(s)"
            log.info(
                f"ShardedEmbeddingBag {self.name!r}: span='auto' on {t.num_nodes} nodes x {t.ranks_per_node}:"
                f" {'a copy per node' if per_node else 'spread over the world'}. Predicted lookups per step:"
                f" {spread_s * 1e3:.2f} ms spread, {copies_s * 1e3:.2f} ms a copy per node (first batch:"
                f" {int(traffic.ids):,} ids, {traffic.remote / max(traffic.ids, 1):.0%} of them on other nodes,"
                f" {int(traffic.distinct / t.num_nodes):,} distinct rows per node; a copy per node holds"
                f" {fmt_bytes(self.copy_bytes(table, largest=True))} per rank: {fit})")
        if per_node:
            local, count, group, owner, replicas = self.node_layout
            rows = spread(table.num_embeddings, count, owner)
            # ranks are node-major (Topology.node_ranks): world rank r holds place r % count of its node's copy
            table.move(local, count, group, owner, replicas, [rows[r % count] for r in range(t.world_size)])
        return per_node


__all__ = ["SpanChoice", "Traffic", "predict"]
