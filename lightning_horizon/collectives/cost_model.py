"""The alpha-beta cost model: what each allreduce algorithm sends, over which link, how long it takes, and which
algorithm ``auto`` picks for a bucket.

A message of ``s`` bytes over a link costs ``alpha + s * beta`` (latency, then seconds per byte). There are two
link classes: intra-node (shared memory / loopback) and inter-node (the NIC). The inter-node link is a node's
NIC, so flows leaving one node in the same round share it: ``k`` flows each take ``k`` times as long.

The model simulates, round by round, the collectives *as they run here* (gloo's ring allreduce; all-to-all and
all-gather as pairwise isend/irecv) on a real placement of ``nodes x ranks_per_node`` ranks. :func:`plan` lists
the stages each of our algorithms issues, with the same chunking and padding the hooks apply (``chunks.py``), so
the model's byte counts are the hooks' byte counts. A pipelined two-level reduction overlaps the row stages of
one chunk with the column stage of another: after the first chunk, each chunk costs the slower of its row and
column work. :class:`BucketPlanner` turns the predictions into a choice per bucket size. (The textbook closed
forms on one link class, which the simulation reproduces, live in tests/test_collectives.py.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from lightning_horizon.collectives.chunks import FP32, chunk_sizes, payload_bytes, round_up

if TYPE_CHECKING:  # config.py imports this module to check a given cost model
    from lightning_horizon.collectives.config import CollectivesConfig


@dataclass(frozen=True)
class Link:
    """One link class: ``alpha`` seconds per message, ``beta`` seconds per byte (1 / bandwidth)."""

    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        return self.alpha + nbytes * self.beta


@dataclass(frozen=True)
class CostModel:
    """Latency and bandwidth of the intra-node and inter-node links."""

    intra: Link
    inter: Link

    @classmethod
    def coerce(cls, value: Any) -> "CostModel":
        """A ``CostModel``, or ``{"intra": (alpha, beta), "inter": (alpha, beta)}``."""
        if isinstance(value, CostModel):
            return value
        try:
            links = {k: Link(float(value[k][0]), float(value[k][1])) for k in ("intra", "inter")}
            if any(v < 0 or not math.isfinite(v) for link in links.values() for v in (link.alpha, link.beta)):
                raise ValueError
            return cls(**links)
        except (TypeError, KeyError, IndexError, ValueError):
            raise ValueError(
                f"cost_model={value!r}: allowed is a CostModel or"
                " {'intra': (alpha_s, beta_s_per_byte), 'inter': (alpha_s, beta_s_per_byte)} of finite numbers >= 0"
            ) from None

    def describe(self) -> str:
        def one(link: Link) -> str:
            bw = 1 / link.beta / 1e9 if link.beta > 0 else float("inf")
            return f"alpha {link.alpha * 1e6:.1f} us, {bw:.2f} GB/s"

        return f"intra-node {one(self.intra)} | inter-node {one(self.inter)}"

    # ------------------------------------------------------------------ our algorithms on a placement

    def predict(
        self,
        algorithm: str,
        numel: int,
        nodes: int,
        ranks_per_node: int,
        compression: Optional[str] = None,
        torus_cols: Optional[int] = None,
        int8_block: int = 256,
        chunk_numel: Optional[int] = None,
    ) -> "Prediction":
        """Time and bytes per rank of one allreduce of ``numel`` fp32 elements by ``algorithm``, pipelined in
        chunks of ``chunk_numel`` elements (``None``: one piece)."""
        world = nodes * ranks_per_node
        cols = {"flat": world, "hierarchical": ranks_per_node, "torus2d": torus_cols or ranks_per_node}[algorithm]
        time, intra, inter = 0.0, np.zeros(world), np.zeros(world)
        for k, stages in enumerate(plan(algorithm, numel, world, cols, compression, int8_block, chunk_numel)):
            t_row = t_col = 0.0
            for kind, axis, nbytes in stages:
                t, a, e = self._stage(kind, _groups(axis, world, cols), nbytes, ranks_per_node)
                intra, inter = intra + a, inter + e
                if axis == "row":
                    t_row += t
                else:
                    t_col += t
            time += t_row + t_col if k == 0 else max(t_row, t_col)
        return Prediction(algorithm, time, float(intra.mean()), float(inter.mean()), float(inter.max()))

    def choose(self, numel: int, nodes: int, ranks_per_node: int, candidates: list[tuple[str, int, int]], **kw: Any):
        """The ``(algorithm, torus_cols, chunk_numel)`` of ``candidates`` predicted fastest (first on a tie)."""
        times = [
            self.predict(a, numel, nodes, ranks_per_node, torus_cols=cols, chunk_numel=chunk, **kw).time
            for a, cols, chunk in candidates
        ]
        return candidates[int(np.argmin(times))]

    def _stage(self, kind: str, groups: list[list[int]], nbytes: float, ranks_per_node: int):
        """Simulate one collective run by every group at once: (time, intra bytes per rank, inter bytes per rank)."""
        world = sum(len(g) for g in groups)
        intra, inter = np.zeros(world), np.zeros(world)
        size = len(groups[0])
        if size == 1:
            return 0.0, intra, inter
        members = np.array(groups)  # [groups, size]: global ranks in group order
        if kind == "allreduce":  # gloo's ring: reduce-scatter then allgather, 2(g-1) rounds of n/g to the right
            rounds = [(1, nbytes / size, 2 * (size - 1))]
        elif kind in ("alltoall", "allgather"):  # pairwise: member j sends n/g to member (j + i) % g in round i
            rounds = [(i, nbytes / size, 1) for i in range(1, size)]  # (all-gather: n is the output's size)
        else:
            raise ValueError(f"kind={kind!r}: allowed are 'allreduce', 'allgather', 'alltoall'")
        time = 0.0
        for shift, chunk, repeat in rounds:
            src = members.reshape(-1)
            dst = np.roll(members, -shift, axis=1).reshape(-1)
            src_node, dst_node = src // ranks_per_node, dst // ranks_per_node
            cross = src_node != dst_node
            # A NIC carries every flow that leaves (or enters) its node in this round: they share its bandwidth.
            out_flows = np.bincount(src_node[cross], minlength=world)
            in_flows = np.bincount(dst_node[cross], minlength=world)
            share = np.maximum(out_flows[src_node], in_flows[dst_node])
            t_inter = self.inter.alpha + chunk * self.inter.beta * share
            t_intra = self.intra.alpha + chunk * self.intra.beta
            time += repeat * float(np.where(cross, t_inter, t_intra).max())
            np.add.at(inter, src[cross], repeat * chunk)
            np.add.at(intra, src[~cross], repeat * chunk)
        return time, intra, inter


@dataclass(frozen=True)
class Prediction:
    """One algorithm's predicted time and bytes sent per rank (mean over ranks, and the busiest rank's inter)."""

    algorithm: str
    time: float
    intra_bytes: float
    inter_bytes: float
    inter_bytes_max: float


def plan(
    algorithm: str,
    numel: int,
    world: int,
    cols: int,
    compression: Optional[str],
    int8_block: int = 256,
    chunk_numel: Optional[int] = None,
) -> list[list[tuple[str, str, float]]]:
    """Per pipelined chunk, the stages ``(kind, axis, bytes per rank)`` the hook issues, padding included.

    ``axis`` is ``"world"``, ``"row"`` (``cols`` consecutive ranks) or ``"col"`` (stride ``cols``). A compressed
    allreduce is an all-to-all of the encoded chunks, a sum in fp32, and an all-gather of the re-encoded sums.
    """
    if algorithm == "flat":
        return [_across("world", world, numel, compression, int8_block)]
    chunks = []
    for size in chunk_sizes(numel, cols, chunk_numel or numel):
        # The row's reduce-scatter is an all-to-all plus a local sum (gloo's own is a full allreduce).
        stages = [("alltoall", "row", FP32 * size)]
        stages += _across("col", world // cols, size // cols, compression, int8_block)
        stages.append(("allgather", "row", FP32 * size))
        chunks.append(stages)
    return chunks


def _across(axis: str, group: int, numel: int, compression: Optional[str], int8_block: int):
    if compression is None:
        return [("allreduce", axis, FP32 * numel)]
    block = int8_block if compression == "int8" else 1
    chunk = round_up(numel, group * block) // group
    wire = group * payload_bytes(chunk, compression, int8_block)
    return [("alltoall", axis, wire), ("allgather", axis, wire)]


def _groups(axis: str, world: int, cols: int) -> list[list[int]]:
    if axis == "world":
        return [list(range(world))]
    if axis == "row":
        return [list(range(r * cols, (r + 1) * cols)) for r in range(world // cols)]
    return [list(range(c, world, cols)) for c in range(cols)]


# ---------------------------------------------------------------------- the choice per bucket


class BucketPlanner:
    """``(algorithm, pipeline chunk in elements)`` for each bucket size: the configured ones, or for ``auto`` the
    cheapest by the cost model, chosen once per bucket size.

    ``auto`` weighs flat, hierarchical and (where its grid is neither of those) torus2d, each two-level one both
    pipelined and in one piece, since every chunk pays every stage's latency again (a ring across 256 nodes has
    510 steps). Every rank holds the same constants (the probe agrees on them), so every rank picks alike.
    """

    def __init__(
        self,
        config: CollectivesConfig,
        nodes: int,
        ranks_per_node: int,
        torus_cols: int,
        model: Optional[CostModel] = None,
        info: Callable[[str], None] = lambda message: None,
    ) -> None:
        if config.algorithm == "auto" and model is None:
            raise ValueError("collectives='auto' needs a cost model: allowed is a CostModel (given or probed)")
        self.config, self.model, self._info = config, model, info
        self.nodes, self.ranks_per_node, self.torus_cols = nodes, ranks_per_node, torus_cols
        #: ``auto``'s choice per bucket size (elements)
        self.choices: dict[int, tuple[str, int]] = {}

    def plan_for(self, numel: int) -> tuple[str, int]:
        """``(algorithm, pipeline chunk in elements)`` for a bucket of ``numel`` elements."""
        cfg = self.config
        chunk = cfg.chunk_numel
        if cfg.algorithm != "auto":
            return cfg.algorithm, chunk
        if numel not in self.choices:
            per_node, world = self.ranks_per_node, self.nodes * self.ranks_per_node
            two_level = [("hierarchical", per_node)]
            if self.torus_cols not in (per_node, world):
                two_level.append(("torus2d", self.torus_cols))
            candidates = [("flat", world, numel)]
            candidates += [(a, cols, c) for a, cols in two_level for c in dict.fromkeys((chunk, numel))]
            assert self.model is not None
            algorithm, _, chunk = self.model.choose(
                numel, self.nodes, per_node, candidates, compression=cfg.compression, int8_block=cfg.int8_block
            )
            self.choices[numel] = (algorithm, chunk)
            pieces = f" in chunks of {chunk * FP32 / 2**20:.3f} MiB" if algorithm != "flat" and chunk < numel else ""
            self._info(f"collectives auto: buckets of {numel * FP32 / 2**20:.3f} MiB -> {algorithm}{pieces}")
        return self.choices[numel]
