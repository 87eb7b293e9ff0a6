"""Measure the links at setup: latency and bandwidth inside the node and between nodes, for ``auto``.

A ring allreduce of ``n`` bytes over ``g`` ranks takes ``2(g-1) alpha + 2(g-1)/g n beta``; timing a small and a
large one gives alpha and beta. The intra-node groups of all nodes probe at once (each node's memory is its
own); between nodes only local rank 0's group probes, so one flow per NIC measures the NIC, which the cost
model then shares among the flows of each round. Every rank takes the maximum over the world of what was
measured, so every rank holds the same constants and ``auto`` picks the same algorithm for a bucket everywhere
(a rank that picked another algorithm would hang its peers).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lightning_horizon.collectives.accounting import CommAccounting
from lightning_horizon.collectives.comm import Comm
from lightning_horizon.collectives.chunks import FP32
from lightning_horizon.collectives.cost_model import CostModel, Link
from lightning_horizon.topology import ProcessGroups

SMALL_NUMEL = 256  # 1 KiB: latency-bound
LARGE_NUMEL = 1 << 18  # 1 MiB: bandwidth-bound, short even on a 1 Gbit/s link (about 16 ms per ring)
REPEATS = 5


def _min_time(comm: Comm, numel: int, repeats: int) -> float:
    buf = torch.zeros(numel)
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


def probe(groups: ProcessGroups, repeats: int = REPEATS) -> CostModel:
    """Probe the links of ``groups``' topology (collective over the world: every rank must call it).

    The probe's traffic goes to an accounting of its own: it is not a training step's.
    """
    topo, scratch = groups.topology, CommAccounting()
    return probe_links(
        Comm(groups.intra, groups.intra_ranks, topo, scratch),
        Comm(groups.inter, groups.inter_ranks, topo, scratch),
        Comm(None, list(range(topo.world_size)), topo, scratch),
        repeats,
    )


def probe_links(intra: Comm, inter: Comm, world: Comm, repeats: int = REPEATS) -> CostModel:
    """Probe both link classes over these groups (collective over the world: every rank must call it)."""
    measured = torch.zeros(4, dtype=torch.float64)
    if intra.size > 1:
        link = _fit(intra, repeats)
        measured[0:2] = torch.tensor([link.alpha, link.beta], dtype=torch.float64)
    if inter.size > 1 and intra.index == 0:
        link = _fit(inter, repeats)
        measured[2:4] = torch.tensor([link.alpha, link.beta], dtype=torch.float64)
    if world.size > 1:
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=world.group)
    a_i, b_i, a_e, b_e = measured.tolist()
    # A class that does not exist here (one rank per node, or one node) borrows the other's constants.
    if intra.size == 1:
        a_i, b_i = a_e, b_e
    if inter.size == 1:
        a_e, b_e = a_i, b_i
    return CostModel(intra=Link(a_i, b_i), inter=Link(a_e, b_e))
