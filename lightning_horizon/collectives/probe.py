"""Measure the links at setup: latency and bandwidth inside the node and between nodes, for ``auto``; and the
codecs' CPU time, which a compressed reduction pays for the bytes it saves.

A ring allreduce of ``n`` bytes over ``g`` ranks takes ``2(g-1) alpha + 2(g-1)/g n beta``; timing a small and a
large one gives alpha and beta. The intra-node groups of all nodes probe at once (each node's memory is its
own); between nodes only local rank 0's group probes, so one flow per NIC measures the NIC, which the cost
model then shares among the flows of each round. Every rank takes the maximum over the world of what was
measured, so every rank holds the same constants and ``auto`` picks the same algorithm for a bucket everywhere
(a rank that picked another algorithm would hang its peers).

The codecs are timed on every rank at once, on its own threads, running the hooks' own compressed allreduce over
a group of the rank alone (its collectives are then copies): the cores a node's ranks share while training are
shared while measuring, too. Where there are several nodes, each codec is then timed where it runs: a whole
compressed hierarchical reduction of a few pipeline chunks over the real groups, and the figure is the one that
makes the cost model's time for it equal the measured time. That figure holds what the solo one leaves out (the
node's ranks coding, summing and copying on the same cores at once, and how much of the codec the pipeline really
hides behind the wire): on 2 cores with 2 ranks each of 2 nodes and a 1 Gbit/s link, int8 came out at 1.0-1.6
GB/s of fp32 there against 2-26 GB/s alone, and with it the model's compressed times were 0.86-1.24 of the
measured ones at 8 and 64 MiB (at 1 MiB 0.51-1.24: docs/collectives.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_horizon.collectives.accounting import CommAccounting
from lightning_horizon.collectives.algorithms import two_level
from lightning_horizon.collectives.comm import Comm
from lightning_horizon.collectives.chunks import FP32, round_up
from lightning_horizon.collectives.compression import Codec, coded_elements, compressed_allreduce
from lightning_horizon.collectives.cost_model import CODECS, CostModel, Link, plan
from lightning_horizon.topology import ProcessGroups, Topology

SMALL_NUMEL = 256  # 1 KiB: latency-bound
LARGE_NUMEL = 1 << 18  # 1 MiB: bandwidth-bound, short even on a 1 Gbit/s link (about 16 ms per ring)
# 2 MiB, the default pipeline chunk: a pipelined two-level reduction codes a slice of one at a time.
CODEC_NUMEL = 1 << 19
# The codec timed where it runs: a pipelined reduction of this many chunks, as a bucket goes (the first chunk's row
# and column stages in series, then each chunk's beside the next's, as far as the cores let them).
IN_PLACE_CHUNKS = 4
REPEATS = 5


def _min_time(comm: Comm, numel: int, repeats: int) -> float:
    buf = torch.zeros(numel, dtype=torch.float32)
    comm.allreduce(buf)  # warm-up: connections, allocations
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        comm.allreduce(buf)
        best = min(best, time.perf_counter() - start)
    return best


def _fit(comm: Comm, repeats: int) -> Link:
    g = comm.size
    t_small, t_large = _min_time(comm, SMALL_NUMEL, repeats), _min_time(comm, LARGE_NUMEL, repeats)
    share = 2 * (g - 1) / g  # bytes on the wire per byte reduced
    beta = max(t_large - t_small, 1e-12) / (share * FP32 * (LARGE_NUMEL - SMALL_NUMEL))
    alpha = max(t_small - share * FP32 * SMALL_NUMEL * beta, 1e-9) / (2 * (g - 1))
    return Link(alpha, beta)


def codec_seconds(compression: str, int8_block: int = 256, numel: int = CODEC_NUMEL, repeats: int = REPEATS) -> float:
    """Seconds per element encoded or decoded by ``compression``'s codec, error feedback and fp32 sum included:
    the best of ``repeats`` runs of :func:`compressed_allreduce` on ``numel`` elements, on this rank's threads.
    Needs no process group."""
    codec = Codec(compression, int8_block)
    alone = Comm(None, [0], Topology(world_size=1, rank=0, ranks_per_node=1), CommAccounting())
    x = torch.randn(numel)
    compressed_allreduce(x, alone, codec)  # warm-up: allocations
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        compressed_allreduce(x, alone, codec)
        best = min(best, time.perf_counter() - start)
    return best / coded_elements(round_up(numel, codec.block), 1)


def probe(
    groups: ProcessGroups, compressions: Sequence[str] = CODECS, int8_block: int = 256, repeats: int = REPEATS
) -> CostModel:
    """Probe the links of ``groups``' topology and the codecs of ``compressions`` (collective over the world:
    every rank must call it).

    The probe's traffic goes to an accounting of its own: it is not a training step's.
    """
    topo, scratch = groups.topology, CommAccounting()
    return probe_links(
        Comm(groups.intra, groups.intra_ranks, topo, scratch),
        Comm(groups.inter, groups.inter_ranks, topo, scratch),
        Comm(None, list(range(topo.world_size)), topo, scratch),
        repeats,
        compressions,
        int8_block,
    )


def probe_links(
    intra: Comm, inter: Comm, world: Comm, repeats: int = REPEATS, compressions: Sequence[str] = (),
    int8_block: int = 256,
) -> CostModel:
    """Probe both link classes over these groups, and the codecs of ``compressions`` (collective over the world:
    every rank must call it)."""
    measured = torch.zeros(4 + len(compressions), dtype=torch.float64)
    # The codecs first: the ranks arrive here together (the groups were just built, collectively), so the ranks
    # of a node share its cores as they will in training, and no link is being timed meanwhile.
    for i, name in enumerate(compressions):
        measured[4 + i] = codec_seconds(name, int8_block, repeats=repeats)
    if intra.size > 1:
        link = _fit(intra, repeats)
        measured[0:2] = torch.tensor([link.alpha, link.beta], dtype=torch.float64)
    if inter.size > 1 and intra.index == 0:
        link = _fit(inter, repeats)
        measured[2:4] = torch.tensor([link.alpha, link.beta], dtype=torch.float64)
    if world.size > 1:
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=world.group)
    a_i, b_i, a_e, b_e, *codec = measured.tolist()
    # A class that does not exist here (one rank per node, or one node) borrows the other's constants.
    if intra.size == 1:
        a_i, b_i = a_e, b_e
    if inter.size == 1:
        a_e, b_e = a_i, b_i
    links = CostModel(intra=Link(a_i, b_i), inter=Link(a_e, b_e))
    if inter.size > 1 and compressions:  # the column stage compresses: time the codec where it runs
        took = torch.tensor([_in_place(intra, inter, Codec(name, int8_block), repeats) for name in compressions],
                            dtype=torch.float64)
        if world.size > 1:
            dist.all_reduce(took, op=dist.ReduceOp.MAX, group=world.group)
        codec = [in_place_seconds(t, links, inter.size, intra.size, name, int8_block, solo)
                 for t, name, solo in zip(took.tolist(), compressions, codec)]
    return CostModel(intra=links.intra, inter=links.inter, codec=dict(zip(compressions, codec)))


def _in_place(intra: Comm, inter: Comm, codec: Codec, repeats: int) -> float:
    """Median seconds of a hierarchical reduction of ``IN_PLACE_CHUNKS`` pipeline chunks over these groups,
    compressed by ``codec`` (collective: every rank runs it, so a node's ranks share its cores as in training)."""
    x = torch.randn(IN_PLACE_CHUNKS * CODEC_NUMEL)
    two_level(x.clone(), intra, inter, codec, CODEC_NUMEL, 1)  # warm-up: connections, allocations
    times = []
    for _ in range(repeats):
        y = x.clone()
        start = time.perf_counter()
        two_level(y, intra, inter, codec, CODEC_NUMEL, 1)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def in_place_seconds(took: float, links: CostModel, nodes: int, per_node: int, compression: str, int8_block: int,
                     solo: float, numel: int = IN_PLACE_CHUNKS * CODEC_NUMEL, chunk_numel: int = CODEC_NUMEL) -> float:
    """Seconds per coded element that make the model's time for a compressed hierarchical reduction of ``numel``
    elements in chunks of ``chunk_numel`` (``links``' time for its bytes and its coded elements at that figure,
    pipelined as the model pipelines them) equal ``took``, its measured time; never below ``solo``, the codec timed
    alone. The model's time grows with the figure, piecewise linearly: found by bisection."""

    def model(seconds: float) -> float:
        links_and_codec = CostModel(links.intra, links.inter, codec={compression: seconds})
        return links_and_codec.predict("hierarchical", numel, nodes, per_node, compression, int8_block=int8_block,
                                       chunk_numel=chunk_numel).time

    coded = any(kind == "codec" for stages in plan("hierarchical", numel, nodes * per_node, per_node, compression,
                                                   int8_block, chunk_numel) for kind, _, _ in stages)
    if not coded or model(solo) >= took:
        return solo
    low, high = solo, max(2 * solo, 1e-10)
    while model(high) < took:
        low, high = high, 2 * high
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if model(mid) < took else (low, mid)
    return high
