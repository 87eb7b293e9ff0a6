"""Who is where (lightning_horizon/topology.py): ranks on nodes, the node and cross-node groups, the placement table.

In-process tests check the arithmetic without a process group; the multi-process test runs two emulated nodes
by NODE_RANK (real gloo runs of tests/scripts/fit.py, each node's ranks forked after its launch's imports) and
checks the groups and the table the strategy builds.
"""

import pytest
import torch

from lightning_horizon import cpu
from lightning_horizon.topology import ProcessGroups, Topology, check_ranks_per_node, cpulist, placement_table
from tests.scripts.fit import launch_forked

# ------------------------------------------------------------------ Topology and check_ranks_per_node


def test_rank_is_node_rank_times_ranks_per_node_plus_local_rank():
    topo = Topology(world_size=8, rank=5, ranks_per_node=4)
    assert (topo.num_nodes, topo.node_rank, topo.local_rank) == (2, 1, 1)
    assert topo.node_ranks(0) == [0, 1, 2, 3] and topo.node_ranks(1) == [4, 5, 6, 7]
    assert topo.cross_ranks(1) == [1, 5] and topo.cross_ranks(3) == [3, 7]
    for rank in range(8):
        t = Topology(8, rank, 4)
        assert rank == t.node_rank * t.ranks_per_node + t.local_rank
        assert rank in t.node_ranks(t.node_rank) and rank in t.cross_ranks(t.local_rank)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 0, 1), r"world_size=0: must be >= 1"),
        ((4, 4, 2), r"rank=4: must be in \[0, 4\)"),
        ((4, -1, 2), r"rank=-1: must be in \[0, 4\)"),
        ((4, 0, 3), r"ranks_per_node=3 does not divide the world size 4: allowed are the divisors \[1, 2, 4\]"),
        ((4, 0, 0), r"Topology\(ranks_per_node=0\): allowed is a positive int"),
    ],
)
def test_topology_rejects_bad_placements(args, match):
    with pytest.raises(ValueError, match=match):
        Topology(*args)


def test_check_ranks_per_node():
    check_ranks_per_node(None)  # the launcher's local world size
    check_ranks_per_node(None, 6)
    check_ranks_per_node(3, 6)
    check_ranks_per_node(5)  # no world size yet: only the type and sign are checked
    with pytest.raises(ValueError, match=r"HorizonStrategy\(ranks_per_node='2'\): allowed is a positive int"):
        check_ranks_per_node("2")
    with pytest.raises(ValueError, match=r"HorizonStrategy\(ranks_per_node=True\)"):
        check_ranks_per_node(True)
    with pytest.raises(ValueError, match=r"ranks_per_node=4 does not divide the world size 6: .*\[1, 2, 3, 6\]"):
        check_ranks_per_node(4, 6)


# ------------------------------------------------------------------ ProcessGroups without a process group


def test_process_groups_lay_the_grids_without_a_process_group():
    assert not torch.distributed.is_initialized()
    groups = ProcessGroups(Topology(world_size=8, rank=5, ranks_per_node=4))
    assert groups.intra is None and groups.inter is None  # no process group: the ranks only
    assert groups.intra_ranks == [4, 5, 6, 7] and groups.inter_ranks == [1, 5]
    pairs = groups.grid(2)  # e.g. torus2d's other grid
    assert (pairs.rows, pairs.cols, pairs.row_ranks, pairs.col_ranks) == (4, 2, [4, 5], [1, 3, 5, 7])
    assert groups.grid(2) is pairs and groups.grid(4).row_ranks == groups.intra_ranks  # built once, cached
    for cols in (0, 3):
        with pytest.raises(ValueError, match=rf"cols={cols}: must divide the world size 8"):
            groups.grid(cols)


def test_shard_groups_are_blocks_of_nodes():
    """8 ranks as 4 nodes x 2, shard groups of 2 nodes: rank 5 (node 2, local rank 1) is in the second group (ranks
    4-7), its peers are local rank 1 on that group's nodes, and its place in the first group is rank 1's."""
    groups = ProcessGroups(Topology(world_size=8, rank=5, ranks_per_node=2))
    g = groups.shard_group(2)
    assert (g.member_ranks, g.peer_ranks, g.across_ranks) == ([4, 5, 6, 7], [5, 7], [1, 5])
    assert groups.shard_group(2) is g and groups.shard_group(1).member_ranks == groups.intra_ranks
    assert groups.shard_group(1).across_ranks == groups.inter_ranks and groups.shard_group(4).across_ranks == [5]
    with pytest.raises(ValueError, match=r"nodes=3: must divide the number of nodes 4"):
        groups.shard_group(3)


# ------------------------------------------------------------------ the placement table and cpulist


def test_cpulist_writes_the_kernels_format():
    assert cpulist([0, 1, 2, 5]) == "0-2,5"
    assert cpulist([7, 3, 4, 0]) == "0,3-4,7"  # sorted first
    assert cpulist([3]) == "3" and cpulist([]) == ""
    text = "0-3,8,10-11"
    assert cpulist(cpu.parse_cpulist(text + "\n")) == text  # the inverse of the parser of /sys cpulists


def test_placement_table_has_a_line_per_rank_and_marks_shared_cores():
    placement = [
        {"rank": 0, "node": 0, "local_rank": 0, "threads": 2, "cores": [0, 1], "shared": False},
        {"rank": 1, "node": 0, "local_rank": 1, "threads": 2, "cores": [2, 3], "shared": False},
        {"rank": 2, "node": 1, "local_rank": 0, "threads": 4, "cores": [9, 4, 5, 6], "shared": True},
        {"rank": 3, "node": 1, "local_rank": 1, "threads": 4, "cores": [4, 5, 6, 9], "shared": True},
    ]
    table = placement_table(Topology(world_size=4, rank=0, ranks_per_node=2), placement, "gloo | AVX2")
    assert table.splitlines() == [
        "HorizonStrategy: 2 node(s) x 2 rank(s) | gloo | AVX2",
        " rank  node  local  threads  cores",
        "    0     0      0        2  0-1",
        "    1     0      1        2  2-3",
        "    2     1      0        4  4-6,9  (shared)",
        "    3     1      1        4  4-6,9  (shared)",
    ]


# ------------------------------------------------------------------ real multi-process runs


def test_two_nodes_by_node_rank_groups_and_shared_cores(tmp_path):
    """4 ranks as 2 nodes x 2, each node a separate process tree launched with NODE_RANK (as on a cluster),
    each node restricted to one core, so its two ranks must share it and the table must say so."""
    runs = [
        {"name": "ddp", "strategy": "ddp", "devices": 2, "num_nodes": 2, "max_steps": 4},
        {"name": "horizon", "strategy": "horizon", "devices": 2, "num_nodes": 2, "max_steps": 4},
    ]
    res = launch_forked(tmp_path, runs, nodes=2, devices=2, tasksets=[["taskset", "-c", "0"], ["taskset", "-c", "1"]])
    ours = res["horizon"]
    assert sorted(ours) == [0, 1, 2, 3]
    for rank, info in ours.items():
        node = rank // 2
        assert info["world"] == 4
        assert info["intra_ranks"] == [2 * node, 2 * node + 1]
        assert info["inter_ranks"] == [rank % 2, rank % 2 + 2]
        torch.testing.assert_close(torch.tensor(info["losses"]), torch.tensor(res["ddp"][rank]["losses"]),
                                   rtol=1e-6, atol=0)
    table = ours[0]["table"]
    assert "2 node(s) x 2 rank(s)" in table and "(shared)" in table
    by_rank = {r["rank"]: r for r in ours[0]["placement"]}
    assert by_rank[0]["cores"] == by_rank[1]["cores"] == [0] and by_rank[0]["shared"]
    assert by_rank[2]["cores"] == by_rank[3]["cores"] == [1]
