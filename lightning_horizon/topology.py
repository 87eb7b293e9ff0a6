"""Who is where: nodes, local ranks, their cores, and the process groups the collectives use.

A rank's place is ``rank = node_rank * ranks_per_node + local_rank``, the order every launcher Lightning
knows assigns. ``ranks_per_node`` normally equals the launcher's local world size; overriding it lets several
"nodes" be emulated on one machine (tests, benchmarks).

Process groups are created collectively: every rank must call ``torch.distributed.new_group`` for every group,
in the same order, even for groups it is not part of. ``ProcessGroups`` does exactly that, once, at setup, and
caches the grids so that the collectives never create a group on a hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from lightning_horizon.checks import is_int, require


@dataclass(frozen=True)
class Topology:
    """The placement of ``world_size`` ranks on ``world_size // ranks_per_node`` nodes."""

    world_size: int
    rank: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r}: must be >= 1")
        check_ranks_per_node(self.ranks_per_node, self.world_size, owner="Topology")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank!r}: must be in [0, {self.world_size})")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node_rank(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    def node_ranks(self, node_rank: int) -> list[int]:
        """The global ranks on one node (the intra-node group of that node)."""
        start = node_rank * self.ranks_per_node
        return list(range(start, start + self.ranks_per_node))

    def cross_ranks(self, local_rank: int) -> list[int]:
        """The global ranks with the same local rank on every node (one inter-node group)."""
        return list(range(local_rank, self.world_size, self.ranks_per_node))


def check_ranks_per_node(
    ranks_per_node: Optional[int], world_size: Optional[int] = None, owner: str = "HorizonStrategy"
) -> None:
    """Raise ``ValueError`` naming ``ranks_per_node`` when it is not a positive divisor of the world size."""
    if ranks_per_node is None:
        return
    require(is_int(ranks_per_node, 1), owner, "ranks_per_node", ranks_per_node,
            "a positive int (or None for the launcher's)")
    if world_size is not None and world_size % ranks_per_node:
        raise ValueError(
            f"ranks_per_node={ranks_per_node!r} does not divide the world size {world_size}:"
            f" allowed are the divisors {[d for d in range(1, world_size + 1) if world_size % d == 0]}"
        )


@dataclass
class Grid:
    """The ranks laid on a ``rows x cols`` grid, row-major: row ``r`` holds ranks ``r*cols .. r*cols+cols-1``.

    ``row`` is this rank's row group (``cols`` consecutive ranks: with ``cols == ranks_per_node`` the node),
    ``col`` its column group (``rows`` ranks with stride ``cols``: the inter-node group). ``None`` where a
    group would hold a single rank, or where no process group is initialized.
    """

    rows: int
    cols: int
    row: Optional[dist.ProcessGroup] = None
    col: Optional[dist.ProcessGroup] = None
    row_ranks: list[int] = field(default_factory=list)
    col_ranks: list[int] = field(default_factory=list)


@dataclass
class ShardGroup:
    """The groups of node-sharded state spread over ``nodes`` consecutive nodes (a shard group): together the ranks
    of a shard group own one copy of the state, and every shard group holds the same copy.

    ``members``: every rank of this rank's shard group (``nodes x ranks_per_node`` consecutive ranks); ``peers``: the
    ranks with this rank's local rank on the nodes of its shard group (the nodes' reducers of the same buckets);
    ``across``: the ranks at this rank's place in every shard group (the owners of the same buckets). ``None`` where
    a group would hold a single rank, or where no process group is initialized.
    """

    nodes: int
    members: Optional[dist.ProcessGroup] = None
    peers: Optional[dist.ProcessGroup] = None
    across: Optional[dist.ProcessGroup] = None
    member_ranks: list[int] = field(default_factory=list)
    peer_ranks: list[int] = field(default_factory=list)
    across_ranks: list[int] = field(default_factory=list)


class ProcessGroups:
    """The intra-node and inter-node groups of a :class:`Topology`, plus any other grid, built once.

    Every rank must construct this object at the same point (the strategy does it in ``setup_environment``)
    and ask for the same grids in the same order.
    """

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._grids: dict[int, Grid] = {}
        self._shard_groups: dict[int, ShardGroup] = {}
        self._spare_inter: Optional[dist.ProcessGroup] = None
        node = self.grid(topology.ranks_per_node)
        self.intra, self.inter = node.row, node.col
        self.intra_ranks, self.inter_ranks = node.row_ranks, node.col_ranks

    def grid(self, cols: int) -> Grid:
        """The grid with ``cols`` ranks per row (created collectively on first request, then cached)."""
        world, rank = self.topology.world_size, self.topology.rank
        if cols < 1 or world % cols:
            raise ValueError(f"cols={cols!r}: must divide the world size {world}")
        if cols not in self._grids:
            rows = world // cols
            g = Grid(rows=rows, cols=cols)
            g.row_ranks = [r for r in range(world) if r // cols == rank // cols]
            g.col_ranks = list(range(rank % cols, world, cols))
            if dist.is_available() and dist.is_initialized() and world > 1:
                # new_group is collective over the default group: every rank creates every group, same order.
                for r in range(rows):
                    ranks = list(range(r * cols, (r + 1) * cols))
                    pg = dist.new_group(ranks) if cols > 1 else None
                    if rank in ranks:
                        g.row = pg
                for c in range(cols):
                    ranks = list(range(c, world, cols))
                    pg = dist.new_group(ranks) if rows > 1 else None
                    if rank in ranks:
                        g.col = pg
            self._grids[cols] = g
        return self._grids[cols]

    def spare_inter(self) -> Optional[dist.ProcessGroup]:
        """A second group of this rank's inter-node ranks (``inter_ranks``), for a collective kept in flight beside
        the step's own (two threads must not issue on one gloo group: each rank would order them differently).
        Created collectively on first request, then cached; ``None`` on one node or without a process group."""
        t = self.topology
        if self._spare_inter is None and dist.is_available() and dist.is_initialized() and t.num_nodes > 1:
            for local in range(t.ranks_per_node):  # collective: every rank creates every group, same order
                pg = dist.new_group(t.cross_ranks(local))
                if local == t.local_rank:
                    self._spare_inter = pg
        return self._spare_inter

    def shard_group(self, nodes: int) -> ShardGroup:
        """The groups of a shard group of ``nodes`` nodes (created collectively on first request, then cached)."""
        t = self.topology
        if nodes < 1 or t.num_nodes % nodes:
            raise ValueError(f"nodes={nodes!r}: must divide the number of nodes {t.num_nodes}")
        if nodes not in self._shard_groups:
            span = nodes * t.ranks_per_node
            block = self.grid(span)  # rows: the shard groups; columns: the same place in every shard group
            first = t.rank // span * span
            g = ShardGroup(nodes=nodes, members=block.row, across=block.col, member_ranks=block.row_ranks,
                           peer_ranks=list(range(first + t.local_rank, first + span, t.ranks_per_node)),
                           across_ranks=block.col_ranks)
            if dist.is_available() and dist.is_initialized() and t.world_size > 1 and nodes > 1:
                for start in range(0, t.world_size, span):  # collective: every rank creates every group, same order
                    for local in range(t.ranks_per_node):
                        ranks = list(range(start + local, start + span, t.ranks_per_node))
                        pg = dist.new_group(ranks)
                        if t.rank in ranks:
                            g.peers = pg
            self._shard_groups[nodes] = g
        return self._shard_groups[nodes]


def placement_table(topology: Topology, placement: list[dict[str, Any]], header: str) -> str:
    """The startup table: ``header`` (backend, ISA, allocator), then one line per rank with its node, local rank,
    threads and cores (``placement``: one dict per rank, as the strategy gathers them at setup)."""
    lines = [
        f"HorizonStrategy: {topology.num_nodes} node(s) x {topology.ranks_per_node} rank(s) | {header}",
        f"{'rank':>5} {'node':>5} {'local':>6} {'threads':>8}  cores",
    ]
    for r in placement:
        lines.append(
            f"{r['rank']:>5} {r['node']:>5} {r['local_rank']:>6} {r['threads']:>8}  {cpulist(r['cores'])}"
            + ("  (shared)" if r["shared"] else "")
        )
    return "\n".join(lines)


def cpulist(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the kernel's cpulist format)."""
    spans: list[str] = []
    for c in sorted(cores):
        if spans and int(spans[-1].split("-")[-1]) == c - 1:
            spans[-1] = f"{spans[-1].split('-')[0]}-{c}"
        else:
            spans.append(str(c))
    return ",".join(spans)
