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

Compression saves bytes on the wire and costs CPU time: encoding, decoding and the error feedback run on the
cores that also train. The model counts it as seconds per element encoded or decoded (``CostModel.codec``,
measured by the probe), for every element a compressed stage codes on a rank, on the thread that issues it, in
series with that stage's bytes. The hooks pipeline the codec of one chunk with the wire of the chunks before it,
but where a node's ranks already fill its cores with coding, summing and copying (2 cores, 2 ranks each of 2
nodes: docs/collectives.md) that overlap did not show: the series form predicted the measured speed-ups within 8%
at 8-64 MiB, where the overlapped one predicted 40-55% less time than measured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from lightning_horizon.collectives.chunks import FP32, chunk_sizes, payload_bytes, round_up
from lightning_horizon.collectives.compression import coded_elements
from lightning_horizon.collectives.config import COMPRESSIONS

if TYPE_CHECKING:  # config.py imports this module to check a given cost model
    from lightning_horizon.collectives.config import CollectivesConfig


@dataclass(frozen=True)
class Link:
    """One link class: ``alpha`` seconds per message, ``beta`` seconds per byte (1 / bandwidth)."""

    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        return self.alpha + nbytes * self.beta


#: the compressions that have a codec (``CostModel.codec``'s keys)
CODECS = tuple(c for c in COMPRESSIONS if c is not None)


@dataclass(frozen=True)
class CostModel:
    """Latency and bandwidth of the intra-node and inter-node links, and the CPU time of the codecs."""

    intra: Link
    inter: Link
    codec: Mapping[str, float] = field(default_factory=dict, hash=False)
    """Seconds per element encoded or decoded, per compression (``"bf16"``, ``"int8"``), error feedback and fp32
    sums included (:func:`~lightning_horizon.collectives.compression.coded_elements` counts the elements). A
    compression not named here costs no CPU time."""

    @classmethod
    def coerce(cls, value: Any) -> "CostModel":
        """A ``CostModel``, or ``{"intra": (alpha, beta), "inter": (alpha, beta)}`` with an optional
        ``"codec": {"bf16": seconds_per_element, "int8": seconds_per_element}``."""
        if isinstance(value, CostModel):
            return value
        try:
            if set(value) - {"intra", "inter", "codec"}:
                raise ValueError
            links = {k: Link(float(value[k][0]), float(value[k][1])) for k in ("intra", "inter")}
            if any(v < 0 or not math.isfinite(v) for link in links.values() for v in (link.alpha, link.beta)):
                raise ValueError
        except (TypeError, KeyError, IndexError, ValueError):
            raise ValueError(
                f"cost_model={value!r}: allowed is a CostModel or"
                " {'intra': (alpha_s, beta_s_per_byte), 'inter': (alpha_s, beta_s_per_byte)} of finite numbers >= 0,"
                f" with an optional 'codec': {{name: seconds_per_element}} for the names {CODECS}"
            ) from None
        codec = value.get("codec")
        try:
            codec = {} if codec is None else codec
            if not isinstance(codec, Mapping) or set(codec) - set(CODECS):
                raise ValueError
            codec = {name: float(seconds) for name, seconds in codec.items()}
            if any(v < 0 or not math.isfinite(v) for v in codec.values()):
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(
                f"cost_model={value!r}: codec={value['codec']!r} is not allowed: allowed is a dict of compression"
                f" names {CODECS} to seconds per element encoded or decoded, finite numbers >= 0"
                " (e.g. {'bf16': 1e-9, 'int8': 2e-9})"
            ) from None
        return cls(**links, codec=codec)

    def describe(self) -> str:
        def one(link: Link) -> str:
            bw = 1 / link.beta / 1e9 if link.beta > 0 else float("inf")
            return f"alpha {link.alpha * 1e6:.1f} us, {bw:.2f} GB/s"

        text = f"intra-node {one(self.intra)} | inter-node {one(self.inter)}"
        if self.codec:
            speeds = (f"{name} {FP32 / s / 1e9 if s > 0 else float('inf'):.2f} GB/s" for name, s in self.codec.items())
            text += f" | codec {', '.join(speeds)} of fp32 per encode or decode"
        return text

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
            for kind, axis, amount in stages:
                if kind == "codec":  # every rank codes at once, on the thread that issues the stage's collectives
                    t = amount * self.codec.get(compression, 0.0)
                else:
                    t, a, e = self._stage(kind, _groups(axis, world, cols), amount, ranks_per_node)
                    intra, inter = intra + a, inter + e
                if axis == "row":
                    t_row += t
                else:
                    t_col += t
            time += t_row + t_col if k == 0 else max(t_row, t_col)
        return Prediction(algorithm, time, float(intra.mean()), float(inter.mean()), float(inter.max()))

    def choose(
        self, numel: int, nodes: int, ranks_per_node: int, candidates: list[tuple[str, int, int, Optional[str]]],
        **kw: Any,
    ):
        """The ``(algorithm, torus_cols, chunk_numel, compression)`` of ``candidates`` predicted fastest (first on a
        tie)."""
        times = [
            self.predict(a, numel, nodes, ranks_per_node, comp, torus_cols=cols, chunk_numel=chunk, **kw).time
            for a, cols, chunk, comp in candidates
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
    allreduce is an all-to-all of the encoded chunks, a sum in fp32, and an all-gather of the re-encoded sums,
    and a ``("codec", axis, elements per rank)`` stage: what each rank encodes or decodes there (no bytes).
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
    if compression is None or group == 1:  # a group of one compresses nothing (the hooks skip it too)
        return [("allreduce", axis, FP32 * numel)]
    block = int8_block if compression == "int8" else 1
    chunk = round_up(numel, group * block) // group
    wire = group * payload_bytes(chunk, compression, int8_block)
    return [("alltoall", axis, wire), ("codec", axis, coded_elements(chunk, group)), ("allgather", axis, wire)]


def _groups(axis: str, world: int, cols: int) -> list[list[int]]:
    if axis == "world":
        return [list(range(world))]
    if axis == "row":
        return [list(range(r * cols, (r + 1) * cols)) for r in range(world // cols)]
    return [list(range(c, world, cols)) for c in range(cols)]


# ---------------------------------------------------------------------- the choice per bucket


class BucketPlanner:
    """``(algorithm, pipeline chunk in elements, compression)`` for each bucket size: the configured ones, or for
    ``auto`` the cheapest by the cost model, chosen once per bucket size.

    ``auto`` weighs flat, hierarchical and (where its grid is neither of those) torus2d, each two-level one both
    pipelined and in one piece, since every chunk pays every stage's latency again (a ring across 256 nodes has
    510 steps). With a ``compression``, each also uncompressed: the codec's CPU time can cost more than the bytes
    it saves (a fast link, a slow CPU), and on a tie the exact sum wins. Every rank holds the same constants (the
    probe agrees on them), so every rank picks alike.
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
        if config.collectives == "auto" and model is None:
            raise ValueError("collectives='auto' needs a cost model: allowed is a CostModel (given or probed)")
        self.config, self.model, self._info = config, model, info
        self.nodes, self.ranks_per_node, self.torus_cols = nodes, ranks_per_node, torus_cols
        #: ``auto``'s choice per bucket size (elements)
        self.choices: dict[int, tuple[str, int, Optional[str]]] = {}

    def plan_for(self, numel: int) -> tuple[str, int, Optional[str]]:
        """``(algorithm, pipeline chunk in elements, compression)`` for a bucket of ``numel`` elements."""
        cfg = self.config
        chunk = cfg.chunk_numel
        if cfg.collectives != "auto":
            return cfg.collectives, chunk, cfg.compression
        if numel not in self.choices:
            per_node, world = self.ranks_per_node, self.nodes * self.ranks_per_node
            two_level = [("hierarchical", per_node)]
            if self.torus_cols not in (per_node, world):
                two_level.append(("torus2d", self.torus_cols))
            shapes = [("flat", world, numel)]
            shapes += [(a, cols, c) for a, cols in two_level for c in dict.fromkeys((chunk, numel))]
            candidates = [(*shape, comp) for comp in dict.fromkeys((None, cfg.compression)) for shape in shapes]
            assert self.model is not None
            algorithm, _, chunk, compression = self.model.choose(
                numel, self.nodes, per_node, candidates, int8_block=cfg.int8_block
            )
            self.choices[numel] = (algorithm, chunk, compression)
            pieces = f" in chunks of {chunk * FP32 / 2**20:.3f} MiB" if algorithm != "flat" and chunk < numel else ""
            coded = f" + {compression}" if compression else ""
            self._info(f"collectives auto: buckets of {numel * FP32 / 2**20:.3f} MiB -> {algorithm}{coded}{pieces}")
        return self.choices[numel]


def sync_efficiency(model: CostModel, numel: int, nodes: int, ranks_per_node: int, compute_s: float,
                    every: int) -> dict[str, float]:
    """Scaling efficiency of the cross-node sync modes on paper: the share of the time a node computes, for a
    model of ``numel`` fp32 parameters whose step computes for ``compute_s`` seconds on every node (weak scaling:
    the same batch per node at any node count), syncing every ``every`` steps where the mode is periodic.

    With T the model's time for a hierarchical allreduce of the weights (or gradients: the same size) across the
    nodes and A its intra-node part alone (one node: the slices gathered back into every rank's weights, which
    every periodic sync pays), H = ``every`` and C = ``compute_s``:

    - ``sync`` (gradients every step): C / (C + T);
    - ``local_sgd`` (the blocking average, or DiLoCo's blocking outer step): H C / (H C + T + A);
    - ``overlapped`` (``sync_overlap=True``): H C / (H C + A + max(0, T - H C)), the exchange hidden behind the
      period's compute as far as it lasts.

    The model leaves out what a measurement shows: the exchange's own CPU time competing with compute on the
    node's cores, and the convergence a period of staleness costs."""
    t = model.predict("hierarchical", numel, nodes, ranks_per_node).time
    a = model.predict("hierarchical", numel, 1, ranks_per_node).time
    c, h = compute_s, every
    return {"exchange_s": t, "sync": c / (c + t), "local_sgd": h * c / (h * c + t + a),
            "overlapped": h * c / (h * c + a + max(0.0, t - h * c))}
