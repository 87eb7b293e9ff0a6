"""Collectives: bad input, the cost model, the codecs, and two worlds of 4 ranks in one launch.

* tests/scripts/collectives_ddp.py: raw torch DDP on gloo, 4 ranks as 2 emulated nodes x 2:
  gradient parity of every hook with DDP's own allreduce over 40 iterations, bitwise agreement across ranks,
  error feedback, byte accounting vs the cost model, loss trajectories, compressed training, local SGD (the
  schedule, and each average against the float64 mean of the nodes' weights before it), bf16 buckets summed in
  fp32, error feedback through a non-finite step.
* tests/scripts/collectives_fit.py: Lightning fits with HorizonStrategy(collectives=...) on the same 4 ranks:
  trajectories vs Lightning's DDP, hook registration on CPU, checkpoint resume of the error feedback and of the
  local-SGD counters, GradNormBackoff under local SGD and through a NaN with int8.

The launch (``launched``, tests/launch.run_worlds) runs once per module: one process start, each world's ranks
forked from it after its imports, one world after the other; the tests below read what each world wrote.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Callable

import lightning as L
import pytest
import torch

from lightning_horizon import HorizonStrategy
from lightning_horizon.collectives import CollectivesConfig, CostModel, Link
from lightning_horizon.collectives.compression import Codec, ErrorFeedback
from lightning_horizon.collectives.cost_model import BucketPlanner, sync_efficiency
from lightning_horizon.collectives.layout import Piece
from tests.launch import assert_exited, run_worlds

pytestmark = pytest.mark.timeout(600)  # both worlds run in the first multi-process test's setup (~2 min here)

# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, name, allowed",
    [
        ({"collectives": "ring"}, "collectives='ring'",
         "allowed is one of ('flat', 'hierarchical', 'torus2d', 'auto')"),
        ({"compression": "fp8"}, "compression='fp8'", "allowed is one of (None, 'bf16', 'int8')"),
        ({"sync_every": 0}, "sync_every=0", "allowed is an int >= 1"),
        ({"sync_every": 2.0}, "sync_every=2.0", "allowed is an int >= 1"),
        ({"sync_warmup_steps": -1}, "sync_warmup_steps=-1", "allowed is an int >= 0"),
        ({"collectives": "torus2d", "torus_shape": (4,)}, "torus_shape=(4,)", "allowed is None or a pair"),
        ({"collectives": "torus2d", "torus_shape": (0, 4)}, "torus_shape=(0, 4)", "allowed is None or a pair"),
        ({"collectives": "flat", "torus_shape": (2, 2)}, "torus_shape=(2, 2)", "collectives='torus2d' or 'auto'"),
        ({"compression": "int8", "sync_every": 2}, "compression='int8'", "allowed is compression=None"),
        ({"collectives": "auto", "cost_model": {"intra": 1}}, "cost_model=", "allowed is a CostModel"),
        ({"int8_block": 0}, "int8_block=0", "allowed is an int >= 1"),
        ({"sync_every": 2, "outer": "adam"}, "outer='adam'", "allowed is one of ('average', 'nesterov')"),
        ({"sync_every": 2, "outer_lr": -1}, "outer_lr=-1", "allowed is a finite number > 0"),
        ({"sync_every": 2, "outer_momentum": 1.0}, "outer_momentum=1.0", "allowed is a number in [0, 1)"),
        ({"sync_every": 2, "sync_overlap": "yes"}, "sync_overlap='yes'", "allowed is True, False or 'auto'"),
        ({"outer": "nesterov", "sync_overlap": True}, "outer='nesterov', sync_overlap=True with sync_every=1",
         "allowed with sync_every > 1"),
    ],
)
def test_bad_config_names_parameter_value_and_allowed(kwargs, name, allowed):
    with pytest.raises(ValueError) as err:
        CollectivesConfig(**kwargs)
    assert name in str(err.value) and allowed in str(err.value)


def test_sync_modes_on_paper():
    """The scaling efficiency of the sync modes (cost_model.sync_efficiency) is its stated formula on the model's own
    times, and orders the modes: hiding the exchange beats waiting for it every H steps, which beats every step."""
    model = CostModel(intra=Link(2e-6, 1 / 20e9), inter=Link(15e-6, 1 / 3.125e9))
    n = 124_000_000
    for nodes in (8, 64, 256):
        t = model.predict("hierarchical", n, nodes, 8).time
        a = model.predict("hierarchical", n, 1, 8).time
        for c, h in ((0.05, 4), (0.5, 2), (2.0, 4)):
            e = sync_efficiency(model, n, nodes, 8, c, h)
            assert e["exchange_s"] == t and e["sync"] == pytest.approx(c / (c + t))
            assert e["local_sgd"] == pytest.approx(h * c / (h * c + t + a))
            assert e["overlapped"] == pytest.approx(h * c / (h * c + a + max(0.0, t - h * c)))
            assert e["overlapped"] >= e["local_sgd"] and (h * c < a or e["local_sgd"] >= e["sync"])
    free = CostModel(intra=Link(0.0, 0.0), inter=Link(0.0, 0.0))
    assert sync_efficiency(free, n, 256, 8, 1.0, 4) == {"exchange_s": 0.0, "sync": 1.0, "local_sgd": 1.0,
                                                        "overlapped": 1.0}


def test_torus_shape_must_match_world_size():
    cfg = CollectivesConfig("torus2d", torus_shape=(3, 2))
    with pytest.raises(ValueError, match=r"torus_shape=\(3, 2\).*world size 4.*allowed are \[\(1, 4\), \(2, 2\)"):
        cfg.grid_shape(world_size=4, ranks_per_node=2)
    assert CollectivesConfig("torus2d").grid_shape(8, 4) == (4, 2)  # default: rows are nodes


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"collectives": "ring"}, "collectives='ring'"),
        ({"compression": "int4"}, "compression='int4'"),
        ({"sync_every": 0}, "sync_every=0"),
        ({"collectives": "torus2d", "torus_shape": (3, 1)}, "torus_shape=(3, 1)"),  # world size 4: at Trainer()
        # 2 emulated nodes x 2: one row of 4 spans both nodes, no column stage to compress
        ({"collectives": "torus2d", "torus_shape": (4, 1), "compression": "int8", "ranks_per_node": 2},
         "a grid of one row spanning 2 nodes has no column stage, the only one compressed"),
        ({"collectives": "hierarchical", "ddp_comm_hook": lambda s, b: None}, "ddp_comm_hook="),
        # the clash names the option the user gave, not the collectives default
        ({"compression": "int8", "ddp_comm_hook": lambda s, b: None}, "with compression='int8': give either"),
    ],
)
def test_strategy_rejects_bad_collectives_before_any_process(kwargs, needle):
    with pytest.raises(ValueError) as err:
        L.Trainer(accelerator="cpu", devices=4, strategy=HorizonStrategy(**kwargs), logger=False)
    assert needle in str(err.value)


def test_a_torus_row_within_one_node_or_with_columns_compresses_and_is_accepted():
    for shape, per_node in (((4, 1), 4), ((2, 2), 2), ((1, 4), 2)):  # one node; columns across nodes
        L.Trainer(accelerator="cpu", devices=4, logger=False, strategy=HorizonStrategy(
            collectives="torus2d", torus_shape=shape, compression="int8", ranks_per_node=per_node))


# ---------------------------------------------------------------------- cost model

LAN = CostModel(intra=Link(2e-6, 1 / 20e9), inter=Link(20e-6, 1 / 1.25e9))  # shared memory; 10 Gbit/s Ethernet


# Textbook closed forms on one link class, for reasoning about crossovers and for checking the simulation.


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



def test_textbook_crossover_recursive_doubling_beats_ring_for_small_messages():
    p, link = 64, Link(10e-6, 1 / 10e9)
    log_p = math.log2(p)
    analytic = (2 * (p - 1) - log_p) * link.alpha / ((log_p - 2 * (p - 1) / p) * link.beta)
    found = crossover(lambda n: recursive_doubling_allreduce(p, n, link), lambda n: ring_allreduce(p, n, link))
    assert found == pytest.approx(analytic, rel=1e-9)
    assert recursive_doubling_allreduce(p, analytic / 10, link) < ring_allreduce(p, analytic / 10, link)
    assert recursive_doubling_allreduce(p, analytic * 10, link) > ring_allreduce(p, analytic * 10, link)
    # Rabenseifner has the ring's bandwidth term with log latency: never slower than the ring, and never slower
    # than the binomial tree.
    for n in (1e2, 1e4, 1e6, 1e8):
        assert rabenseifner_allreduce(p, n, link) <= ring_allreduce(p, n, link)
        assert rabenseifner_allreduce(p, n, link) <= binomial_tree_allreduce(p, n, link)


def test_simulation_reproduces_the_textbook_ring_on_one_link_class():
    n = 1 << 20
    one_node = LAN.predict("flat", n, nodes=1, ranks_per_node=8)
    assert one_node.time == pytest.approx(ring_allreduce(8, 4 * n, LAN.intra), rel=1e-12)
    one_per_node = LAN.predict("flat", n, nodes=8, ranks_per_node=1)
    assert one_per_node.time == pytest.approx(ring_allreduce(8, 4 * n, LAN.inter), rel=1e-12)
    assert one_per_node.inter_bytes == pytest.approx(2 * 7 / 8 * 4 * n)


@pytest.mark.parametrize("nodes", [2, 8, 16, 64, 256])
@pytest.mark.parametrize("per_node", [2, 8])
def test_inter_node_bytes_match_closed_forms_and_hierarchical_never_exceeds_flat(nodes, per_node):
    world = nodes * per_node
    for numel in (world * 256, world * 65536):
        flat = LAN.predict("flat", numel, nodes, per_node)
        hier = LAN.predict("hierarchical", numel, nodes, per_node)
        nbytes = 4 * numel
        # Flat ring: one rank per node sends 2(P-1)/P of the bucket across; hierarchical: every rank 2(N-1)/N of 1/L.
        assert flat.inter_bytes == pytest.approx(2 * (world - 1) / world * nbytes / per_node)
        assert flat.inter_bytes_max == pytest.approx(2 * (world - 1) / world * nbytes)
        assert hier.inter_bytes == pytest.approx(2 * (nodes - 1) / nodes * nbytes / per_node)
        assert hier.inter_bytes <= flat.inter_bytes and hier.inter_bytes_max <= flat.inter_bytes_max
        torus = LAN.predict("torus2d", numel, nodes, per_node)  # default shape: rows are nodes, the same stages
        assert (torus.time, torus.inter_bytes) == (hier.time, hier.inter_bytes)


def test_compressed_plans_carry_a_quarter_or_half_of_the_bytes_across_nodes():
    numel, nodes, per_node = 1 << 20, 4, 2
    base = LAN.predict("hierarchical", numel, nodes, per_node).inter_bytes
    bf16 = LAN.predict("hierarchical", numel, nodes, per_node, compression="bf16").inter_bytes
    int8 = LAN.predict("hierarchical", numel, nodes, per_node, compression="int8", int8_block=256).inter_bytes
    assert bf16 == pytest.approx(base / 2)
    assert int8 == pytest.approx(base / 4 * (1 + 4 / 256))  # int8 values plus one fp32 scale per 256


def test_auto_choice_follows_the_crossover_on_given_constants():
    # Same constants on both link classes (loopback "nodes"): hierarchical has fewer latency terms (4 vs 6 on
    # 2 x 2) and 4/3 of the bytes, so it wins below about 4 alpha / (0.5 beta) bytes and flat above.
    same = CostModel.coerce({"intra": (1e-6, 1e-9), "inter": (1e-6, 1e-9)})
    for numel, best in ((416, "hierarchical"), (3135, "flat")):
        assert same.choose(numel, 2, 2, [("flat", 4, numel, None), ("hierarchical", 2, numel, None)])[0] == best
    # A slow inter-node link: hierarchical for every size on 2 x 8.
    for numel in (1 << 10, 1 << 16, 1 << 22):
        candidates = [("flat", 16, numel, None), ("hierarchical", 8, numel, None)]
        assert LAN.choose(numel, 2, 8, candidates)[0] == "hierarchical"
    # Pipelining pays each stage's latency once per chunk: worth it on 2 nodes, not across 256 of them.
    numel, chunk = 1 << 21, 1 << 19
    assert LAN.choose(numel, 2, 8, [("hierarchical", 8, numel, None), ("hierarchical", 8, chunk, None)])[2] == chunk
    assert LAN.choose(numel, 256, 2, [("hierarchical", 2, numel, None), ("hierarchical", 2, chunk, None)])[2] == numel


# The codec's CPU time. Counted here from what compressed_allreduce does, apart from the code under test.


def coded_per_rank(numel: int, group: int, block: int) -> int:
    """Elements one rank encodes or decodes in a compressed allreduce of ``numel`` elements over ``group`` members:
    its input padded to ``group`` chunks of whole blocks (encoded, decoded for its error), what it receives and
    what it gathers (decoded), and its chunk of the sum (encoded, decoded for its error)."""
    chunk = -(-numel // (group * block)) * block
    return 3 * group * chunk + group * chunk + 2 * chunk


@pytest.mark.parametrize(
    "algorithm, compression, chunk_numel, coded",
    [
        # flat: the whole bucket over the 4 ranks
        ("flat", "int8", None, coded_per_rank(100_003, 4, 256)),
        ("flat", "bf16", None, coded_per_rank(100_003, 4, 1)),
        # hierarchical / torus2d: each rank's half of the (even-padded) bucket, across the 2 nodes
        ("hierarchical", "int8", None, coded_per_rank(50_002, 2, 256)),
        ("torus2d", "bf16", None, coded_per_rank(50_002, 2, 1)),
        # pipelined in chunks of 2**15: three full chunks and one of 1700 (100_004 - 3 * 2**15), each halved
        ("hierarchical", "int8", 1 << 15, 3 * coded_per_rank(1 << 14, 2, 256) + coded_per_rank(850, 2, 256)),
    ],
)
def test_compressed_prediction_adds_the_codec_time_of_every_coded_element(algorithm, compression, chunk_numel, coded):
    numel, per_element = 100_003, 3e-9
    costly = CostModel(LAN.intra, LAN.inter, codec={compression: per_element})
    kw = {"compression": compression, "chunk_numel": chunk_numel}
    with_codec = costly.predict(algorithm, numel, 2, 2, **kw)
    without = LAN.predict(algorithm, numel, 2, 2, **kw)
    # The column (slow inter-node link) is the longer side of every pipelined chunk, so the whole term shows.
    assert with_codec.time - without.time == pytest.approx(per_element * coded, rel=1e-9)
    assert (with_codec.intra_bytes, with_codec.inter_bytes, with_codec.inter_bytes_max) == (
        without.intra_bytes, without.inter_bytes, without.inter_bytes_max)  # bytes on the wire unchanged
    other = "bf16" if compression == "int8" else "int8"  # a codec not named in the model costs nothing
    assert costly.predict(algorithm, numel, 2, 2, compression=other).time == LAN.predict(
        algorithm, numel, 2, 2, compression=other).time


def test_one_node_codes_nothing():
    """Inside one node the two-level algorithms have no column stage to compress, so no codec time either."""
    costly = CostModel(LAN.intra, LAN.inter, codec={"int8": 1e-6})
    for algorithm in ("hierarchical", "torus2d"):
        assert costly.predict(algorithm, 1 << 16, 1, 4, "int8").time == LAN.predict(algorithm, 1 << 16, 1, 4).time


@pytest.mark.parametrize(
    "inter, per_element, expect",
    [
        ((50e-6, 1 / 125e6), 2e-9, "int8"),  # 1 Gbit/s: 4x fewer bytes are worth the coding
        ((15e-6, 1 / 3.125e9), 2e-9, None),  # 25 Gbit/s: the same codec costs more than the bytes it saves
        ((50e-6, 1 / 125e6), 1e-8, None),  # 1 Gbit/s and a slow codec
        ((15e-6, 1 / 3.125e9), 0.0, "int8"),  # a free codec: compression always pays (bytes only)
    ],
)
def test_auto_compresses_only_where_the_model_predicts_a_gain(inter, per_element, expect):
    numel, per_node = 1 << 22, 2  # 16 MiB buckets on 2 nodes x 2
    model = CostModel.coerce({"intra": (2e-6, 1 / 20e9), "inter": inter, "codec": {"int8": per_element}})
    planner = BucketPlanner(CollectivesConfig("auto", compression="int8"), 2, per_node, per_node, model)
    algorithm, chunk, compression = planner.plan_for(numel)
    assert compression == expect
    best = {c: min(model.predict(a, numel, 2, per_node, c, chunk_numel=k).time
                   for a in ("flat", "hierarchical") for k in (numel, CollectivesConfig().chunk_numel))
            for c in (None, "int8")}
    assert (best["int8"] < best[None]) == (expect == "int8")  # the promise: compressed only for a predicted gain
    assert model.predict(algorithm, numel, 2, per_node, compression, chunk_numel=chunk).time == min(best.values())
    # A configured algorithm keeps the configured compression, whatever the model says.
    assert BucketPlanner(CollectivesConfig("hierarchical", compression="int8"), 2, 2, 2).plan_for(numel)[2] == "int8"


@pytest.mark.parametrize(
    "codec, shown",
    [
        ({"fp8": 1e-9}, "codec={'fp8': 1e-09}"),
        ({"int8": -1e-9}, "codec={'int8': -1e-09}"),
        ({"int8": float("nan")}, "codec={'int8': nan}"),
        ({"bf16": "fast"}, "codec={'bf16': 'fast'}"),
        ([1e-9], "codec=[1e-09]"),
    ],
)
def test_coerce_rejects_a_bad_codec_by_name(codec, shown):
    value = {"intra": (1e-6, 1e-9), "inter": (1e-5, 1e-8), "codec": codec}
    for build in (CostModel.coerce, lambda v: CollectivesConfig("auto", cost_model=v)):
        with pytest.raises(ValueError) as err:
            build(value)
        message = str(err.value)
        assert message.startswith("cost_model={") and shown in message
        assert "allowed is a dict of compression names ('bf16', 'int8') to seconds per element" in message


def test_coerce_takes_an_optional_codec_and_describe_shows_its_throughput():
    links = {"intra": (1e-6, 1e-9), "inter": (1e-5, 1e-8)}
    assert CostModel.coerce(links).codec == {}  # as before: no codec time
    model = CostModel.coerce({**links, "codec": {"int8": 2e-9, "bf16": 1}})
    assert model.codec == {"int8": 2e-9, "bf16": 1.0}
    assert model.describe() == ("intra-node alpha 1.0 us, 1.00 GB/s | inter-node alpha 10.0 us, 0.10 GB/s"
                                " | codec int8 2.00 GB/s, bf16 0.00 GB/s of fp32 per encode or decode")
    with pytest.raises(ValueError, match=r"cost_model=\{.*'codecs'.*allowed is a CostModel"):  # a misspelt key
        CostModel.coerce({**links, "codecs": {"int8": 2e-9}})


def test_probe_measures_the_codecs_without_a_process_group():
    from lightning_horizon.collectives.accounting import CommAccounting
    from lightning_horizon.collectives.comm import Comm
    from lightning_horizon.collectives.probe import codec_seconds, probe_links
    from lightning_horizon.topology import Topology

    for name in ("bf16", "int8"):
        seconds = codec_seconds(name, numel=1 << 14, repeats=2)
        # Per element, not per call: well under 10 us even on oversubscribed cores (a call takes far longer).
        assert 0 < seconds < 1e-5 and math.isfinite(seconds)
    alone = Comm(None, [0], Topology(world_size=1, rank=0, ranks_per_node=1), CommAccounting())
    model = probe_links(alone, alone, alone, repeats=1, compressions=("int8",))
    assert list(model.codec) == ["int8"] and 0 < model.codec["int8"] < 1e-5
    assert "codec int8" in model.describe()


def test_the_codec_timed_in_place_is_what_makes_the_model_give_the_measured_time():
    """The in-place figure: a pipelined reduction measured at the model's time for it with the codec at s gives s
    back (the model then predicts the measured time), never below the solo figure; a codec not coded here (one
    node) keeps the solo figure."""
    from lightning_horizon.collectives.probe import CODEC_NUMEL, IN_PLACE_CHUNKS, in_place_seconds

    numel = IN_PLACE_CHUNKS * CODEC_NUMEL
    for s in (7e-9, 3e-7):  # the codec hidden behind the row stages, and longer than them
        model = CostModel(LAN.intra, LAN.inter, codec={"int8": s})
        took = model.predict("hierarchical", numel, 2, 2, "int8", chunk_numel=CODEC_NUMEL).time
        assert in_place_seconds(took, LAN, 2, 2, "int8", 256, solo=1e-9) == pytest.approx(s, rel=1e-6)
    wire = LAN.predict("hierarchical", numel, 2, 2, "int8", chunk_numel=CODEC_NUMEL).time
    assert in_place_seconds(wire * 0.5, LAN, 2, 2, "int8", 256, solo=1e-9) == 1e-9  # faster than its bytes: solo
    assert in_place_seconds(wire * 2, LAN, 1, 4, "int8", 256, solo=1e-9) == 1e-9  # one node: nothing coded


def test_a_bucket_auto_sends_uncompressed_carries_its_residual_exactly():
    """With compression configured, ``auto`` may send a bucket uncompressed: the residual fed back into it goes
    along, exactly, and is then spent (world of one: nothing to compress, so ``auto`` never compresses)."""
    from lightning_horizon.collectives import GradientSync
    from lightning_horizon.state import TrainingState
    from lightning_horizon.topology import ProcessGroups, Topology

    module = torch.nn.Linear(3, 2)
    config = CollectivesConfig("auto", compression="int8", cost_model={"intra": (1e-6, 1e-9), "inter": (1e-6, 1e-9)})
    sync = GradientSync.with_links(config, ProcessGroups(Topology(1, 0, 1)), module, TrainingState())
    params = [p for _, p in module.named_parameters()]
    residual = torch.linspace(-1, 1, 8)
    sync.error_feedback.scatter(Piece.contiguous(params), residual)
    grads = torch.arange(8.0)
    bucket = Piece.contiguous(params, grads.clone())
    out = sync.reduce(bucket).wait()
    assert sync.planner.choices[8][2] is None
    assert torch.equal(out, grads + residual)
    assert not sync.error_feedback.residual  # spent: nothing is fed back twice


# ---------------------------------------------------------------------- codecs and error feedback


def test_int8_codec_error_is_within_half_a_step_and_keeps_overflow_visible():
    codec = Codec("int8", int8_block=4)
    x = torch.tensor([[0.1, -0.5, 0.25, 0.0, 1e3, 1.0, -2.0, 3.0, float("inf"), 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    out = codec.decode(codec.encode(x), 16)
    step = x[:, :8].view(2, 4).abs().amax(1, keepdim=True) / 127
    assert ((out[:, :8] - x[:, :8]).view(2, 4).abs() <= step / 2 + 1e-7).all()
    assert not torch.isfinite(out[0, 8:12]).any()  # an inf in a block: the whole block stays non-finite
    assert (out[0, 12:] == 0).all()  # an all-zero block decodes to zeros (scale 1, no 0/0)
    bf16 = Codec("bf16")
    y = torch.randn(3, 64)
    assert ((bf16.decode(bf16.encode(y), 64) - y).abs() <= y.abs() * 2**-8).all()


@pytest.mark.parametrize("block", [3, 50, 256])
def test_int8_blocks_of_any_size_round_trip_as_the_reference_quantization(block):
    """Any ``int8_block`` >= 1 is allowed: a row's scales then start at a byte offset that need not be 4-aligned (a
    block of 3 or 50 crashed decoding the one-row sum). Each value is its block's ``round(x * (1 / s))`` times
    ``s`` with ``s = max|x| / 127``, computed here apart from the codec; and the compressed allreduce of one rank
    gives the value back, what it lost held as the error (to fp32 rounding)."""
    from lightning_horizon.collectives.accounting import CommAccounting
    from lightning_horizon.collectives.comm import Comm
    from lightning_horizon.collectives.compression import compressed_allreduce
    from lightning_horizon.topology import Topology

    torch.manual_seed(0)
    codec, c = Codec("int8", int8_block=block), block * 7
    for rows in (1, 3):
        x = torch.randn(rows, c) * 10
        ref_scale = x.view(rows, -1, block).abs().amax(-1, keepdim=True) / 127
        ref = (x.view(rows, -1, block) * (1 / ref_scale)).round().clamp(-127, 127) * ref_scale
        assert torch.equal(codec.decode(codec.encode(x), c), ref.view(rows, c))
    alone = Comm(None, [0], Topology(world_size=1, rank=0, ranks_per_node=1), CommAccounting())
    x = torch.randn(c + 1)  # padded to whole blocks inside
    total, error = compressed_allreduce(x.clone(), alone, codec)  # overwritten
    assert total.shape == error.shape == x.shape and (error.abs() > 0).any()
    assert torch.allclose(total + error, x, rtol=0, atol=1e-6)  # the error feedback holds what the codec lost


@pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
                    reason="no C compiler: the int8 codec runs on torch ops only")
@pytest.mark.parametrize("block", [3, 50, 64, 256])  # multiples of 64: the AVX-512 path where the CPU has it
def test_int8_kernel_gives_the_torch_codecs_bytes_errors_and_sums(block):
    """The C kernel and the torch ops are one codec: the same packed bytes, the same error written or added, the
    same decoded rows and the same row sum, bit for bit, including all-zero blocks, blocks of subnormal values and
    blocks holding NaN or inf (which must decode non-finite)."""
    native, ops = Codec("int8", int8_block=block, native=True), Codec("int8", int8_block=block, native=False)
    assert native.native and not ops.native
    torch.manual_seed(1)
    c = block * 37
    for rows in (1, 4):
        x = torch.randn(rows, c) * 10
        x[0, 3 * block : 4 * block] = 0
        # tiny blocks: 1 / scale overflows to inf (subnormal max), or is just finite (the clamp-free fast path)
        x[0, 5 * block : 6 * block] *= 1e-42
        x[0, 6 * block : 7 * block] *= 1e-37
        x[-1, 2], x[-1, block + 1] = float("nan"), float("-inf")
        for accumulate in (False, True):
            errors = [torch.randn(rows, c), None]
            errors[1] = errors[0].clone()
            a, b = native.encode(x, errors[0], accumulate), ops.encode(x, errors[1], accumulate)
            assert torch.equal(a, b)
            assert torch.equal(errors[0], errors[1]) or torch.equal(*(e.nan_to_num(7.0) for e in errors))
            assert torch.isnan(errors[0][-1, :block]).all()  # the NaN's block: its error is NaN too
        decoded = native.decode(a, c)
        assert torch.equal(decoded.nan_to_num(7.0), ops.decode(b, c).nan_to_num(7.0))
        assert (decoded[0, 3 * block : 4 * block] == 0).all() and not torch.isfinite(decoded[-1, : 2 * block]).any()
        assert torch.equal(native.decode_sum(a, c).nan_to_num(7.0), ops.decode_sum(b, c).nan_to_num(7.0))
        assert torch.equal(native.encode(x), a)  # no error asked: the same bytes


def test_int8_kernel_build_failure_falls_back_to_torch_ops_and_says_so(monkeypatch, tmp_path, caplog):
    from lightning_horizon.collectives import native

    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("HORIZON_KERNEL_CACHE", str(tmp_path))
    native.int8_kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=native.__name__):
            assert not Codec("int8").native
        assert "runs on torch ops" in caplog.text
        with pytest.raises(RuntimeError, match="native=True"):
            Codec("int8", native=True)
    finally:
        native.int8_kernel.cache_clear()


def _fed_back(ef: ErrorFeedback, params: list) -> torch.Tensor:
    """What ``ef`` adds to a bucket of ``params`` holding ones (bucket layout)."""
    x = torch.ones(sum(p.numel() for p in params))
    ef.add_to(Piece.contiguous(params), x)
    return x - 1


def test_error_feedback_stores_pieces_of_a_bucket_and_zero_around_them():
    """A two-level reduction returns its error as pieces (this rank's slices): stored, they are the bucket-layout
    tensor with zeros elsewhere, whether a piece lies inside one parameter or spans two, into the tensors held."""
    a, b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(5))
    ef = ErrorFeedback([("a", a), ("b", b)])
    ef.scatter(Piece.contiguous([a, b]), torch.arange(1.0, 12.0))
    held = ef.residual["a"]
    ef.scatter(Piece.contiguous([a, b]), [(1, torch.tensor([7.0, 8.0])), (4, torch.tensor([1.0, 2.0, 3.0, 4.0]))])
    assert ef.residual["a"] is held
    assert torch.equal(_fed_back(ef, [a, b]), torch.tensor([0, 7, 8, 0, 1, 2, 3, 4, 0, 0, 0.0]))


def test_error_feedback_follows_parameters_across_a_bucket_rebuild():
    a, b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(5))
    ef = ErrorFeedback([("a", a), ("b", b)])
    assert torch.equal(_fed_back(ef, [a, b]), torch.zeros(11))  # nothing fed back yet
    ef.scatter(Piece.contiguous([a, b]), torch.arange(11.0))  # iteration 0: one bucket [a, b]
    # After the rebuild: [b] and [a] in their own buckets, in the other order.
    assert torch.equal(_fed_back(ef, [b]), torch.arange(6.0, 11.0))
    assert torch.equal(_fed_back(ef, [a]), torch.arange(6.0))
    held = ef.residual["a"]
    ef.scatter(Piece.contiguous([b, a]), torch.arange(11.0, 22.0))  # stored into the tensors already held
    assert ef.residual["a"] is held
    assert torch.equal(_fed_back(ef, [a, b]), torch.cat([torch.arange(16.0, 22.0), torch.arange(11.0, 16.0)]))
    state = ef.state_dict()
    assert all(state["residual"][n] is not ef.residual[n] for n in "ab")  # a copy: later steps do not change it
    fresh = ErrorFeedback([("a", a), ("b", b)])
    fresh.load_state_dict(state)
    assert torch.equal(_fed_back(fresh, [b, a]), torch.cat([torch.arange(11.0, 16.0), torch.arange(16.0, 22.0)]))
    ef.scatter(Piece.contiguous([a]), None)  # consumed without compression: zero
    assert "a" not in ef.residual and torch.equal(_fed_back(ef, [a]), torch.zeros(6))
    with pytest.raises(ValueError, match="shape"):
        fresh.load_state_dict({"residual": {"a": torch.zeros(3)}})


# ---------------------------------------------------------------------- raw DDP, 4 ranks (one launch)

_PARITY = ["flat", "hierarchical", "torus2d", "auto", "hierarchical_chunked"]
_COMPRESSED = ["flat_int8", "hierarchical_int8", "torus2d_bf16", "hierarchical_int8_chunked"]
DDP_CHECKS = (
    [f"{kind}_equal_{v}" for v in _PARITY for kind in ("parity", "bitwise", "accounting")]
    + [f"{kind}_equal_{v}" for v in _COMPRESSED for kind in ("error_feedback", "bitwise", "accounting")]
    + [f"{kind}_odd_{v}" for v in ("hierarchical", "torus2d", "auto", "hierarchical_chunked")
       for kind in ("parity", "bitwise", "accounting")]
    + [f"{kind}_odd_hierarchical_int8" for kind in ("error_feedback", "bitwise", "accounting")]
    + ["auto_choices_odd", "trajectory_hierarchical", "trajectory_torus2d"]
    + ["compressed_training_hierarchical_int8", "compressed_training_flat_bf16"]
    + ["local_sgd_schedule", "local_sgd_mean", "local_sgd_state", "outer_nesterov", "outer_overlap",
       "outer_auto"]
    + [f"bf16_sum_{v}" for v in ("flat", "hierarchical", "torus2d", "local_sgd")]
    + [f"nonfinite_{v}" for v in ("flat_int8", "hierarchical_int8", "torus2d_bf16")]
)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Both worlds of 4 ranks (raw DDP, then the Lightning fits) in one launch: ``(work, {tag: how it ended})``."""
    work = tmp_path_factory.mktemp("collectives")
    env = {"OMP_NUM_THREADS": 1}
    jobs = [{"tag": "ddp", "devices": 4, "call": "tests.scripts.collectives_ddp:main",
             "args": [str(work / "checks.json")], "env": env},
            {"tag": "fit", "devices": 4, "call": "tests.scripts.collectives_fit:main",
             "args": [str(work / "out"), str(work)], "env": env}]
    ended, _ = run_worlds(jobs, work, timeout=600)
    return work, ended


@pytest.fixture(scope="module")
def ddp_checks(launched) -> dict:
    work, ended = launched
    assert_exited(ended, "ddp", [0] * 4)
    return json.loads((work / "checks.json").read_text())


@pytest.mark.parametrize("name", DDP_CHECKS)
def test_raw_ddp(ddp_checks, name):
    assert "script" not in ddp_checks, ddp_checks["script"]["detail"]
    assert name in ddp_checks, f"check {name} did not run"
    assert ddp_checks[name]["ok"], ddp_checks[name]["detail"]


# ---------------------------------------------------------------------- Lightning, 4 ranks (one launch)


@pytest.fixture(scope="module")
def fits(launched) -> list[dict]:
    work, ended = launched
    assert_exited(ended, "fit", [0] * 4)
    return [json.loads((work / f"out.rank{r}.json").read_text()) for r in range(4)]


def test_lightning_registers_our_hooks_on_cpu(fits):
    for ranks in fits:
        for name in ("flat", "hierarchical", "torus2d", "auto"):
            assert ranks[name]["comm_hook"] == f"{name}_hook"
        assert ranks["local_sgd_whole"]["comm_hook"] == "local_sgd_hook"


@pytest.mark.parametrize("algorithm", ["flat", "hierarchical", "torus2d"])
def test_lightning_50_steps_match_ddp(fits, algorithm):
    for ranks in fits:
        ref, got = ranks["ddp"]["losses"], ranks[algorithm]["losses"]
        assert len(got) == len(ref) == 50
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)


def test_lightning_accounting_matches_the_cost_model(fits):
    """Per rank per step: 4 buckets of 1056 elements, as the cost model counts them (mean over the ranks)."""
    expect = [LAN.predict("hierarchical", 1056, 2, 2), LAN.predict("flat", 1056, 2, 2)]
    for name, p in zip(("hierarchical", "flat"), expect):
        intra = sum(r[name]["metrics"]["comm/intra_bytes"] for r in fits) / 4
        inter = sum(r[name]["metrics"]["comm/inter_bytes"] for r in fits) / 4
        assert (intra, inter) == pytest.approx((4 * p.intra_bytes, 4 * p.inter_bytes))
        assert all(r[name]["metrics"]["comm/seconds"] > 0 for r in fits)


def test_lightning_resume_restores_error_feedback(fits):
    for ranks in fits:
        saved, restored = ranks["int8_first"]["state_at_end"], ranks["int8_resumed"]["state_at_start"]
        assert saved["residual"] and restored["residual"] == saved["residual"]  # per rank, exact
        whole, first, resumed = (ranks[f"int8_{k}"]["losses"] for k in ("whole", "first", "resumed"))
        assert first == whole[:10]
        # Bitwise: DDP's first iteration after the restart puts every gradient in one bucket, which the hook
        # reduces as the checkpoint's buckets (collectives/layout.py), so the int8 blocks fall where they did.
        assert resumed == whole[10:]


def test_lightning_resume_continues_local_sgd_without_a_new_warmup(fits):
    for ranks in fits:
        assert ranks["local_sgd_first"]["state_at_end"]["periodic"] == {"step": 10, "syncs": 1}
        assert ranks["local_sgd_resumed"]["state_at_start"]["periodic"] == {"step": 10, "syncs": 1}
        assert ranks["local_sgd_resumed"]["state_at_end"]["periodic"] == {"step": 20, "syncs": 3}
        assert ranks["local_sgd_whole"]["state_at_end"]["periodic"] == {"step": 20, "syncs": 3}
        # The checkpoint fell on a sync: every node resumes from what rank 0 saved, exactly as it would have run.
        assert ranks["local_sgd_resumed"]["losses"] == ranks["local_sgd_whole"]["losses"][10:]


def test_backoff_under_local_sgd_clips_each_node_by_its_own_norm(fits):
    """Between parameter averages each node has its own gradients: GradNormBackoff clips a node by the node's
    norm (a world norm would shrink node 0's step by node 1's), while spikes, skips and the lr scale stay
    world-wide, identical on every rank."""
    from tests.scripts.collectives_fit import BACKOFF_MAX_NORM, BACKOFF_SPIKE

    steps = [ranks["backoff_local_sgd"]["steps"] for ranks in fits]
    assert len(steps[0]) == 10
    for i in range(10):
        row = [s[i] for s in steps]
        node0, node1 = row[0]["norm"], row[2]["norm"]
        assert row[1]["norm"] == node0 and row[3]["norm"] == node1  # equal gradients inside a node
        assert BACKOFF_MAX_NORM < node0 < BACKOFF_SPIKE < node1  # both clipped; only node 1 spikes
        assert all(r["clipped"] == pytest.approx(BACKOFF_MAX_NORM, rel=1e-3) for r in row)
        assert all(r["clip_error"] <= 1e-6 for r in row)  # torch's clip of the node's own gradients
        assert all(r["world"] == node1 and r["scale"] == pytest.approx(0.8 ** (i + 1)) for r in row)
        assert len({(r["world"], r["scale"]) for r in row}) == 1


def test_backoff_skips_a_nan_step_under_int8_and_the_run_goes_on(fits):
    for ranks in fits:
        steps = ranks["int8_nan"]["steps"]
        assert [s["skipped"] for s in steps] == [0, 0, 0] + [1] * 7  # NaN on rank 1 at step 3: every rank skips
        assert all(s["finite"] for s in steps) and all(math.isfinite(x) for x in ranks["int8_nan"]["losses"])
        residual = ranks["int8_nan"]["state_at_end"]["residual"]
        assert residual and all(math.isfinite(v) for sums in residual.values() for v in sums)


def test_reduce_scatter_sums_bf16_in_fp32_and_float64_in_float64():
    from lightning_horizon.collectives.comm import Comm

    for dtype, want in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.float64, torch.float64)):
        received = torch.tensor([[1.0, 2.0], [1e-9, 3.0]], dtype=dtype)
        total = Comm.reduce_scatter_finish((None, received))
        assert total.dtype == want
    assert Comm.reduce_scatter_finish((None, torch.tensor([[1.0], [1e-12]], dtype=torch.float64))).item() == 1.0 + 1e-12


def test_error_feedback_residuals_shrink_with_clipped_gradients():
    """A clipped step used factor x its gradient: the residual it leaves is scaled alike, for its parameters only."""
    a, b = torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(5))
    ef = ErrorFeedback([("a", a), ("b", b)])
    ef.scatter(Piece.contiguous([a, b]), torch.arange(11.0))
    ef.scale([a], 0.5)
    assert torch.equal(ef.residual["a"], torch.arange(6.0) / 2) and torch.equal(ef.residual["b"], torch.arange(6.0, 11))
