"""The alpha-beta cost model: what each allreduce algorithm sends, over which link, and how long it takes.

A message of ``s`` bytes over a link costs ``alpha + s * beta`` (latency, then seconds per byte). There are two
link classes: intra-node (shared memory / loopback) and inter-node (the NIC). The inter-node link is a node's
NIC, so flows leaving one node in the same round share it: ``k`` flows each take ``k`` times as long.

Two layers:

* textbook closed forms on one link class (ring, recursive doubling, Rabenseifner, binomial tree), for reasoning
  and for checking crossovers;
* a round-by-round simulation of the collectives *as they run here* (gloo's ring allreduce; all-to-all and
  all-gather as pairwise isend/irecv) on a real placement of ``nodes x ranks_per_node`` ranks. :func:`plan` lists the stages each of our
  algorithms issues, with the same chunking and padding the hooks apply, so the model's byte counts are the
  hooks' byte counts. A pipelined two-level reduction overlaps the row stages of one chunk with the column
  stage of another: after the first chunk, each chunk costs the slower of its row and column work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

FP32 = 4


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


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def payload_bytes(numel: int, compression: Optional[str], int8_block: int) -> int:
    """Bytes on the wire for ``numel`` elements (``numel`` a multiple of the block for int8)."""
    if compression is None:
        return FP32 * numel
    if compression == "bf16":
        return 2 * numel
    return numel + FP32 * (numel // int8_block)  # int8 values, then one fp32 scale per block


def chunk_sizes(numel: int, row_size: int, chunk_numel: int) -> list[int]:
    """How a two-level reduction cuts ``numel`` elements: chunks of ``chunk_numel`` rounded up to a multiple of
    the row, the last one shorter and padded to a multiple of the row."""
    padded = round_up(numel, row_size)
    chunk = round_up(max(chunk_numel, 1), row_size)
    full, rest = divmod(padded, chunk)
    return [chunk] * full + ([rest] if rest else [])


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


# ---------------------------------------------------------------------- textbook closed forms (one link class)


def ring_allreduce(p: int, n: float, link: Link) -> float:
    """Ring: 2(p-1) steps of n/p bytes (bandwidth-optimal, latency linear in p)."""
    return 2 * (p - 1) * (link.alpha + n / p * link.beta)


def recursive_doubling_allreduce(p: int, n: float, link: Link) -> float:
    """Recursive doubling: log2 p exchanges of the whole message (latency-optimal)."""
    return math.ceil(math.log2(p)) * (link.alpha + n * link.beta)


def rabenseifner_allreduce(p: int, n: float, link: Link) -> float:
    """Recursive-halving reduce-scatter + recursive-doubling allgather: log latency, ring bandwidth."""
    return 2 * math.ceil(math.log2(p)) * link.alpha + 2 * (p - 1) / p * n * link.beta


def binomial_tree_allreduce(p: int, n: float, link: Link) -> float:
    """Binomial-tree reduce then broadcast of the whole message."""
    return 2 * math.ceil(math.log2(p)) * (link.alpha + n * link.beta)


def crossover(f: Callable[[float], float], g: Callable[[float], float], lo: float = 1.0, hi: float = 2.0**40) -> float:
    """The message size where ``f - g`` changes sign, by bisection on a log scale."""
    d_lo = f(lo) - g(lo)
    if d_lo * (f(hi) - g(hi)) > 0:
        raise ValueError(f"no crossover between {lo} and {hi} bytes")
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if (f(mid) - g(mid)) * d_lo > 0:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)
