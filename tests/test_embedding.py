"""ShardedEmbeddingBag: lookups, sparse optimizers and their composition with HorizonStrategy, against references.

In one process: the module equals ``nn.EmbeddingBag`` (forward and gradient), each sparse optimizer equals its
definition (SparseAdagrad: ``torch.optim.Adagrad`` on sparse gradients), bad arguments fail naming themselves.

In real gloo fits (tests/scripts/embedding_fit.py; one launch of 4 ranks, then one of 2), in float64: the losses,
the dense weights and every row of the tables (one row-sharded, two held whole by one rank each) equal a
single-process reference that takes the same steps on the
whole batch: with SGD, plain ``nn.EmbeddingBag`` + ``torch.optim.SGD`` (dense, the optimizers coincide); with the
sparse optimizers, the unplaced module stepping itself; GradNormBackoff's and Lightning's clipping by the global norm
(the tables' gradients counted); the saved table loads into ``nn.EmbeddingBag`` with ``strict=True``; a checkpoint
of 4 ranks resumes on 2 (and one of 2 on 2) as if never interrupted; validate after fit gives the reference's loss.
On 2 emulated nodes x 2 with ``span="node"`` (a copy of each table per node, its rows' gradients summed across the
nodes): the same reference, and a checkpoint that resumes with the tables spread over the world. With
``span="auto"``: on a slow link between the nodes the tables move to a copy per node at the first lookup (a fresh
fit, and one resumed from a checkpoint of tables spread over the world, whose rows and optimizer state move), on
latency-bound links they stay spread; either way the reference's results.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_horizon.collectives import CostModel
from lightning_horizon.embedding import (RowWiseAdagrad, RowWiseAdam, ShardedEmbeddingBag, SparseAdagrad, SparseSGD,
                                        table_owners, tables_of)
from lightning_horizon.embedding.span import SpanChoice, Traffic, predict
from tests.launch import REPO, run_script
from tests.scripts.embedding_fit import BATCH, CLIP, ROWS, SMALL, Risk, dataset

FIT = REPO / "tests" / "scripts" / "embedding_fit.py"
STEPS = 3

RUNS_4 = [
    {"name": "sgd", "optimizer": "sgd", "steps": STEPS},
    {"name": "rwa", "optimizer": "rowwise_adagrad", "dense": "AdamW", "clip": "backoff", "weights": True,
     "steps": STEPS},
    {"name": "adagrad", "optimizer": "adagrad", "mode": "mean", "clip": "trainer-norm", "steps": STEPS},
    {"name": "adam", "optimizer": "rowwise_adam", "dense": "AdamW", "steps": STEPS},
    {"name": "half", "optimizer": "rowwise_adagrad", "dense": "AdamW", "steps": 2},  # resumed on 2 ranks
    # span="node" on 2 emulated nodes x 2: a copy per node, the touched rows' gradients summed across the nodes
    {"name": "node", "optimizer": "rowwise_adagrad", "dense": "AdamW", "clip": "backoff", "weights": True,
     "span": "node", "rpn": 2, "steps": STEPS},
    {"name": "nodehalf", "optimizer": "rowwise_adagrad", "dense": "AdamW", "span": "node", "rpn": 2, "steps": 2},
    # span="auto" on 2 emulated nodes x 2: moved to a copy per node at the first lookup, or left spread (graph
    # sharding's profile runs the first forward once more, and undoes what it did: the choice waits for the step's)
    {"name": "auto", "optimizer": "rowwise_adam", "dense": "AdamW", "clip": "backoff", "weights": True,
     "span": "auto", "rpn": 2, "links": "slow-inter", "sharding": "auto", "steps": STEPS},
    {"name": "autoworld", "optimizer": "rowwise_adagrad", "dense": "AdamW", "span": "auto", "rpn": 2,
     "links": "latency", "steps": STEPS},
    # per-sample weights that come from a parameter: their gradient comes back from the rows' owners
    {"name": "gain", "optimizer": "rowwise_adagrad", "dense": "AdamW", "clip": "backoff", "weights": "trainable",
     "steps": STEPS},
    {"name": "gainnode", "optimizer": "rowwise_adam", "dense": "AdamW", "weights": "trainable", "span": "node",
     "rpn": 2, "steps": STEPS},
    # the big table's rows on disk (a cache of every row a rank holds here: 10 of 37), a copy per node too
    {"name": "disk", "optimizer": "rowwise_adagrad", "dense": "AdamW", "clip": "backoff", "disk": 10, "steps": STEPS},
    {"name": "disknode", "optimizer": "rowwise_adam", "dense": "AdamW", "weights": "trainable", "span": "node",
     "rpn": 2, "disk": 19, "steps": STEPS},
    {"name": "diskhalf", "optimizer": "rowwise_adagrad", "dense": "AdamW", "disk": 10, "steps": 2},  # resumed on 2
]
# one batch per epoch: every resumed step takes the same data, wherever Lightning's loop resumes its epoch
RESUME = {"optimizer": "rowwise_adagrad", "dense": "AdamW", "steps": 4, "epoch_steps": 1}
RUNS_2 = [
    {"name": "sgd", "optimizer": "sgd", "steps": STEPS},
    {"name": "rwa", "optimizer": "rowwise_adagrad", "dense": "AdamW", "clip": "backoff", "weights": True,
     "steps": STEPS},
    {"name": "own", "optimizer": "rowwise_adagrad", "dense": "AdamW", "steps": 2},
    {"name": "gainsgd", "optimizer": "sgd", "weights": "trainable", "steps": STEPS},
    # on disk with a cache of 16 of a rank's 19 rows: rows are evicted and read again
    {"name": "disk", "optimizer": "rowwise_adam", "dense": "AdamW", "clip": "backoff", "weights": "trainable",
     "disk": 16, "steps": STEPS},
]


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> dict[int, Path]:
    work = tmp_path_factory.mktemp("embedding")
    out = {4: work / "w4", 2: work / "w2"}
    for world, runs in ((4, RUNS_4), (2, RUNS_2)):
        out[world].mkdir()
        if world == 4:  # a checkpoint of tables spread over the world resumes into span="auto", which moves them
            runs = runs + [{**RESUME, "name": "autofrom", "span": "auto", "rpn": 2, "links": "slow-inter",
                            "resume_from": str(out[4] / "half.ckpt")}]
        if world == 2:  # the 4-rank checkpoint resumes on 2 ranks; the 2-rank one on 2
            runs = runs + [{**RESUME, "name": "from4", "resume_from": str(out[4] / "half.ckpt")},
                           {**RESUME, "name": "from2", "resume_from": str(out[2] / "own.ckpt")},
                           {**RESUME, "name": "fromnode", "resume_from": str(out[4] / "nodehalf.ckpt")},
                           # on disk, 4 ranks -> 2: into a table in memory and into one on disk
                           {**RESUME, "name": "fromdisk", "disk": 16, "resume_from": str(out[4] / "diskhalf.ckpt")},
                           {**RESUME, "name": "diskfrom4", "disk": 16, "resume_from": str(out[4] / "half.ckpt")}]
        cfg = out[world] / "cfg.json"
        cfg.write_text(json.dumps({"world": world, "runs": runs}))
        run_script(FIT, [cfg, out[world]], timeout=300)
    return out


def reference(cfg: dict, blocks: list[tuple[int, int]]) -> tuple[Risk, list[float]]:
    """One process, the unplaced module, the same steps on each step's whole batch (``blocks``: ``(world,
    epoch_steps)`` of each step's data)."""
    torch.manual_seed(0)
    model = Risk(cfg["optimizer"], cfg.get("dense", "SGD"), cfg.get("mode", "sum"), cfg.get("weights", False),
                 span=cfg.get("span", "world"), seeded=cfg.get("disk") is not None)
    opt = model.configure_optimizers()
    losses = []
    for step, (world, epoch_steps) in enumerate(blocks):
        n = world * BATCH
        k = step % epoch_steps
        data = dataset(n * epoch_steps)[k * n:(k + 1) * n]
        loss = model.loss(data)
        opt.zero_grad()
        loss.backward()
        losses.append(float(loss.detach()))
        tables = list(tables_of(model).values())
        for t in tables:
            t.take_gradient()
        if cfg.get("clip"):
            dense = [p.grad for p in model.parameters() if p.grad is not None]
            norm = torch.sqrt(sum((g * g).sum() for g in dense) + sum(t.gradient_share(2.0) for t in tables))
            coef = torch.clamp(CLIP / (norm + 1e-6), max=1.0)
            for g in dense:
                g.mul_(coef)
            for t in tables:
                t.scale_gradient(coef)
        opt.step()
        for t in tables:
            t.sparse_step()
    return model, losses


def load(folder: Path, name: str) -> tuple[dict, dict]:
    error = folder / f"{name}.error"
    assert not error.exists(), error.read_text()
    return torch.load(folder / f"{name}.pt"), torch.load(folder / f"{name}.ckpt", weights_only=False)


def assert_matches(folder: Path, name: str, model: Risk, losses: list[float]) -> None:
    result, ckpt = load(folder, name)
    assert result["losses"] == pytest.approx(losses, rel=1e-10)
    state = ckpt["state_dict"]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} {key}: {m}")
    plain = nn.EmbeddingBag(ROWS, state["emb.weight"].shape[1], dtype=torch.float64)
    plain.load_state_dict({"weight": state["emb.weight"]}, strict=True)
    plain = nn.EmbeddingBag(SMALL[1], state["smalls.1.weight"].shape[1], dtype=torch.float64)
    plain.load_state_dict({"weight": state["smalls.1.weight"]}, strict=True)  # held whole by rank 1


@pytest.mark.parametrize("world, name", [(4, "sgd"), (4, "rwa"), (4, "adagrad"), (4, "adam"), (4, "node"), (4, "auto"),
                                         (4, "autoworld"), (4, "gain"), (4, "gainnode"), (4, "disk"),
                                         (4, "disknode"), (2, "sgd"), (2, "rwa"), (2, "gainsgd"), (2, "disk")])
def test_fit_equals_single_process_reference(fits, world, name):
    cfg = {r["name"]: r for r in (RUNS_4 if world == 4 else RUNS_2)}[name]
    model, losses = reference(cfg, [(world, cfg["steps"])] * cfg["steps"])
    assert_matches(fits[world], name, model, losses)
    # validate after fit, on the placed tables: the reference's loss on the same data
    result, _ = load(fits[world], name)
    # rank 0's rows: of the world's ranks, or (span="node") of its node's 2, with a copy on each of the 2 nodes
    per_node = cfg.get("span") == "node" or cfg.get("links") == "slow-inter"
    assert (result["rows"], result["copies"], result["owners"]) == (
        ((0, 19), 2, [0, 1]) if per_node else ((0, -(-ROWS // world)), 1, [0, 1]))
    with torch.no_grad():
        val = [float(model.loss(dataset(world * BATCH * 2, seed=2)[i * BATCH:(i + 1) * BATCH]))
               for i in range(world * 2)]
    assert result["val_loss"] == pytest.approx(sum(val) / len(val), rel=1e-10)


@pytest.mark.parametrize("world, name", [(4, "sgd"), (2, "gainsgd")])
def test_sgd_equals_plain_embedding_bag_with_torch_sgd(fits, world, name):
    """SGD on the touched rows is SGD on the dense table (untouched rows get a zero gradient); per-sample weights
    from a parameter get the gradient ``nn.EmbeddingBag`` gives them."""
    trainable = name == "gainsgd"
    torch.manual_seed(0)
    model = Risk("sgd", weighted="trainable" if trainable else False)
    plains = [nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode="sum", dtype=torch.float64)
              for t in (model.emb, *model.smalls)]
    for plain, t in zip(plains, (model.emb, *model.smalls)):
        plain.weight.data.copy_(t.weight.data)
    head = model.head
    gain = [model.gain] if trainable else []
    opt = torch.optim.SGD([*(p.weight for p in plains), *head.parameters(), *gain], lr=0.5)
    data = dataset(world * BATCH * STEPS)
    for k in range(STEPS):
        ids, weights, labels = data[k * world * BATCH:(k + 1) * world * BATCH]
        first = plains[0](ids, per_sample_weights=weights * model.gain) if trainable else plains[0](ids)
        pooled = first + sum(p(ids % n) for p, n in zip(plains[1:], SMALL))
        loss = F.binary_cross_entropy_with_logits(head(pooled).squeeze(1), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, ckpt = load(fits[world], name)
    for key, plain in zip(("emb", "smalls.0", "smalls.1"), plains):
        torch.testing.assert_close(ckpt["state_dict"][f"{key}.weight"], plain.weight.detach(), rtol=1e-10,
                                   atol=1e-12)
    if trainable:
        torch.testing.assert_close(ckpt["state_dict"]["gain"], model.gain.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name, first", [("from4", 4), ("from2", 2), ("fromnode", 4), ("fromdisk", 4),
                                         ("diskfrom4", 4)])
def test_resume_into_another_world_size(fits, name, first):
    """As if never interrupted, on 2 ranks, from 4 or 2; a table on disk from one on disk or in memory (the
    in-memory reference is seeded alike)."""
    # the reference is seeded as the table that wrote the checkpoint (its rows are the ones that count)
    cfg = {**RESUME, "disk": 16} if name == "fromdisk" else RESUME
    model, losses = reference(cfg, [(first, 2), (first, 2), (2, 1), (2, 1)])
    assert_matches(fits[2], name, model, losses[2:])


def test_resume_into_span_auto_moves_rows_and_optimizer_state(fits):
    """A checkpoint of tables spread over 4 ranks resumes on 2 nodes x 2 into span="auto", which moves each table
    (its rows and their row-wise Adagrad state) to a copy per node at the first lookup: as if never interrupted."""
    model, losses = reference(RESUME, [(4, 2), (4, 2), (4, 1), (4, 1)])
    assert_matches(fits[4], "autofrom", model, losses[2:])
    result, _ = load(fits[4], "autofrom")
    assert (result["rows"], result["copies"]) == ((0, 19), 2)


# ---------------------------------------------------------------------------------------------- one process


def test_module_equals_embedding_bag_forward_and_gradient():
    torch.manual_seed(0)
    for mode in ("sum", "mean"):
        ours = ShardedEmbeddingBag(20, 3, mode=mode, dtype=torch.float64)
        plain = nn.EmbeddingBag(20, 3, mode=mode, dtype=torch.float64)
        plain.weight.data.copy_(ours.weight.data)
        ids, offsets = torch.tensor([1, 2, 2, 19, 0, 5]), torch.tensor([0, 3, 3, 4])  # an empty bag
        torch.testing.assert_close(ours(ids, offsets), plain(ids, offsets))
        ours(ids, offsets).pow(2).sum().backward()
        plain(ids, offsets).pow(2).sum().backward()
        torch.testing.assert_close(ours.weight.grad.to_dense(), plain.weight.grad)
    # per-sample weights that need a gradient get nn.EmbeddingBag's
    ours, plain = (ShardedEmbeddingBag(20, 3, dtype=torch.float64), nn.EmbeddingBag(20, 3, mode="sum",
                                                                                     dtype=torch.float64))
    plain.weight.data.copy_(ours.weight.data)
    w = torch.rand(6, dtype=torch.float64, requires_grad=True)
    grads = []
    for bag in (ours, plain):
        w.grad = None
        bag(ids, offsets, per_sample_weights=w).pow(2).sum().backward()
        grads.append(w.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])
    w = torch.rand(6, dtype=torch.float64)
    torch.testing.assert_close(ours.__class__(20, 3, dtype=torch.float64).to(torch.float64)(ids, offsets, w).shape,
                               torch.Size([4, 3]))


def test_sparse_adagrad_equals_torch_adagrad_on_sparse_gradients():
    torch.manual_seed(0)
    ours = ShardedEmbeddingBag(10, 3, optimizer=SparseAdagrad(lr=0.3), dtype=torch.float64)
    plain = nn.EmbeddingBag(10, 3, mode="sum", sparse=True, dtype=torch.float64)
    plain.weight.data.copy_(ours.weight.data)
    opt = torch.optim.Adagrad(plain.parameters(), lr=0.3)
    for ids in (torch.tensor([[1, 2], [2, 7]]), torch.tensor([[7, 7], [0, 1]])):
        ours(ids).sum().backward()
        ours.take_gradient()
        ours.sparse_step()
        opt.zero_grad()
        plain(ids).sum().backward()
        opt.step()
        torch.testing.assert_close(ours.weight.data, plain.weight.data, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(ours.optimizer_state["sum"], opt.state[plain.weight]["sum"])


def test_rowwise_optimizers_follow_their_definitions():
    """Row-wise Adagrad and Adam, written out per row: untouched rows, their state and step counts stay."""
    rows, grad = torch.tensor([0, 3]), torch.tensor([[1.0, 3.0], [0.5, -0.5]], dtype=torch.float64)
    w0 = torch.arange(8, dtype=torch.float64).view(4, 2)
    w, opt = w0.clone(), RowWiseAdagrad(lr=0.1, eps=1e-8)
    state = opt.init_state(4, 2, torch.float64)
    for _ in range(2):
        opt.step(w, state, rows, grad, 0.05)
    acc = torch.tensor([5.0, 0.25], dtype=torch.float64)  # mean(g*g) per row
    expect = w0.clone()
    for t in (1, 2):
        expect[rows] -= 0.05 * grad / (torch.sqrt(acc * t) + 1e-8).unsqueeze(1)
    torch.testing.assert_close(w, expect)
    assert state["sum"][1:3].eq(0).all() and torch.equal(w[1:3], w0[1:3])

    w, opt = w0.clone(), RowWiseAdam(lr=0.1, betas=(0.8, 0.9), eps=1e-8)
    state = opt.init_state(4, 2, torch.float64)
    opt.step(w, state, rows, grad, 0.1)
    opt.step(w, state, rows[:1], grad[:1], 0.1)  # row 3 not touched the second time
    m, v, expect = torch.zeros(2), 0.0, w0[0].clone()
    for t in (1, 2):
        m = 0.8 * m + 0.2 * grad[0]
        v = 0.9 * v + 0.1 * 5.0
        expect -= 0.1 * (m / (1 - 0.8 ** t)) / (math.sqrt(v / (1 - 0.9 ** t)) + 1e-8)
    torch.testing.assert_close(w[0], expect)
    assert state["step"].tolist() == [2.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("kwargs, match", [
    ({"num_embeddings": 0}, r"num_embeddings=0\): allowed is an int >= 1"),
    ({"mode": "max"}, r"mode='max'\): allowed is one of \('sum', 'mean'\)"),
    ({"optimizer": "adamw"}, r"optimizer='adamw'\): allowed is one of"),
    ({"dtype": torch.bfloat16}, r"dtype=torch.bfloat16\): allowed is one of"),
    ({"rows_on_disk": "/tmp/t"}, r"rows_on_disk='/tmp/t'\): allowed is a folder together with an init_seed"),
    ({"rows_on_disk": 3, "init_seed": 1}, r"rows_on_disk=3\): allowed is None or a folder"),
    ({"cache_rows": 10}, r"cache_rows=10\): allowed is None, or an int >= 1 together with rows_on_disk"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardedEmbeddingBag(**{"num_embeddings": 10, "embedding_dim": 2, **kwargs})


def test_ids_out_of_range_and_weights_with_mean_are_refused():
    bag = ShardedEmbeddingBag(10, 2, mode="mean")
    with pytest.raises(IndexError, match=r"ids must be in \[0, 10\); got \[0, 10\]"):
        bag(torch.tensor([[0, 10]]))
    with pytest.raises(ValueError, match="per_sample_weights need mode='sum'"):
        bag(torch.tensor([[0, 1]]), per_sample_weights=torch.ones(1, 2))


class _Refused(Risk):
    def __init__(self, case: str) -> None:
        super().__init__("rowwise_adagrad", dtype=torch.float32)
        self.case = case
        self.data = dataset(8)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=BATCH)

    def configure_optimizers(self):
        if self.case == "lbfgs":
            return torch.optim.LBFGS(self.parameters())
        if self.case == "not-in-optimizer":
            return torch.optim.SGD(self.head.parameters(), lr=0.1)
        return super().configure_optimizers()


@pytest.mark.parametrize("case, extra, match", [
    ("lbfgs", {}, "ShardedEmbeddingBag cannot step LBFGS: LBFGS evaluates its closure several times"),
    ("not-in-optimizer", {}, "ShardedEmbeddingBag 'emb' is in none of the optimizers"),
    ("bf16-true", {"precision": "bf16-true"}, "keeps its table and optimizer state in float32 or float64; the"
     " precision plugin made it torch.bfloat16"),
    ("store", {"strategy_kwargs": {"state_store": "auto"}}, "both take the parameters' storage"),
])
def test_what_cannot_compose_is_refused_by_name(tmp_path, case, extra, match):
    import lightning as L

    from lightning_horizon import HorizonStrategy

    extra = dict(extra)
    strategy = HorizonStrategy(**extra.pop("strategy_kwargs", {}))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=str(tmp_path), **extra)
    with pytest.raises(ValueError, match=match):
        trainer.fit(_Refused(case))


def test_a_seeded_table_draws_only_the_rows_a_rank_holds():
    """init_seed: the rows are drawn block by block, when first used; a placed table draws only its own rows, the
    same values the whole table has (blocks of 65,536 rows: 150,000 rows over 3 ranks cross block boundaries)."""
    whole = ShardedEmbeddingBag(150_000, 2, init_seed=7, init_std=0.5)
    assert whole.weight.shape[0] == 0  # nothing drawn at construction
    whole(torch.tensor([[0, 149_999]]))
    assert whole.weight.shape == (150_000, 2) and 0.45 < float(whole.weight.std()) < 0.55
    for rank in range(3):
        part = ShardedEmbeddingBag(150_000, 2, init_seed=7, init_std=0.5)
        part.place(rank, 3, group=None)
        lo, hi = part.rows
        assert torch.equal(part.weight.data, whole.weight.data[lo:hi])
    other = ShardedEmbeddingBag(150_000, 2, init_seed=8)
    other.load_state_dict(whole.state_dict())  # loaded rows replace drawing
    torch.testing.assert_close(other.weight.data, whole.weight.data)


def test_span_auto_prices_both_layouts():
    """The model span="auto" decides by (span.py), by hand on 2 nodes x 2: what crosses the NIC spread over the world
    (remote ids; partial sums and their gradients to the 2 peers on the other node, for both ranks of a node) against
    a copy per node (the node's distinct rows, row number + row, to the other node), and the rounds of latency."""
    t = Traffic(ids=1000, bags=100, remote=500, world_peers=250, node_peers=750, distinct=80)
    sums = 2 * 100 / 4 * 64  # per peer: 25 bags' partial sums of 64 bytes, and as many gradients back
    bandwidth = CostModel.coerce({"intra": (0.0, 1e-9), "inter": (0.0, 1e-6)})
    spread, copies = predict(t, bandwidth, nodes=2, per_node=2, row_bytes=64, id_bytes=16, columns=2)
    assert spread == pytest.approx((250 / 4 * 16 + sums) * 1e-9 + 2 * (500 / 4 * 16 + 2 * sums) * 1e-6)
    assert copies == pytest.approx((750 / 4 * 16 + sums) * 1e-9 + 40 * (8 + 64) * 1e-6)
    assert copies < spread
    latency = CostModel.coerce({"intra": (1e-3, 0.0), "inter": (1e-3, 0.0)})
    spread, copies = predict(t, latency, nodes=2, per_node=2, row_bytes=64, id_bytes=16, columns=2)
    assert (spread, copies) == pytest.approx((5e-3, 8e-3))  # the row sums add 3 rounds across the nodes
    # one rank per node: a copy per node is local, only the row sums cross
    spread, copies = predict(t, latency, nodes=4, per_node=1, row_bytes=64, id_bytes=16, columns=2)
    assert (spread, copies) == pytest.approx((5e-3, 3e-3))


def test_span_auto_counts_a_batch_and_keeps_a_copy_that_does_not_fit_spread(monkeypatch):
    """What a rank's first batch sends either way, on 2 nodes x 1 (this rank on node 0 holds rows [0, 50) spread,
    all 100 as a copy per node), and the memory rule: a copy per node must fit in half this rank's share."""
    topology = SimpleNamespace(rank=0, node_rank=0, num_nodes=2, ranks_per_node=1, world_size=2)
    choice = SpanChoice("t", topology, (0, 1, None, None, (0, 2, None)), links=lambda: None)
    table = ShardedEmbeddingBag(100, 4, init_seed=0)
    table.place(0, 2, group=None)
    ids = torch.tensor([3, 3, 60, 99, 99, 99])
    # ids, bags, on the other node, on another rank of this node (spread; a copy per node), distinct rows, misfit
    assert choice.measure(table, ids, bags=2).tolist() == [6, 2, 4, 0, 0, 3, 0]
    monkeypatch.setenv("HORIZON_AVAILABLE_MEMORY", "0")  # the share: this process's RSS alone
    huge = ShardedEmbeddingBag(10**9, 16, init_seed=0)  # 64 GB a copy, never drawn here
    assert choice.copy_bytes(huge) == 10**9 * (16 + 1) * 4  # rows and their row-wise Adagrad state
    assert choice.measure(huge, ids, bags=2)[-1] == 1


def test_table_wise_tables_go_largest_first_to_the_least_loaded_rank():
    tables = {name: ShardedEmbeddingBag(rows, dim, placement="table") for name, rows, dim in
              (("a", 10, 4), ("b", 30, 4), ("c", 20, 4), ("d", 5, 2))}
    tables["rows"] = ShardedEmbeddingBag(1000, 4)  # row-sharded: no owner
    assert table_owners(tables, 2) == {"b": 0, "c": 1, "a": 1, "d": 0}
    lone = tables["c"]
    lone.place(2, 3, group=None, owner=2)
    assert lone.bounds == [(0, 0), (0, 0), (0, 20)] and lone.weight.shape == (20, 4)


# ---------------------------------------------------------------------------------------------- rows on disk


def _twins(tmp_path, optimizer, cache_rows, mode="sum", rows=200_000):
    kw = dict(mode=mode, optimizer=optimizer, init_seed=5, dtype=torch.float64)
    return (ShardedEmbeddingBag(rows, 4, **kw),
            ShardedEmbeddingBag(rows, 4, rows_on_disk=tmp_path, cache_rows=cache_rows, **kw))


def _train(tables, steps, seed=1, accumulate=2):
    """The same lookups, backward and sparse steps on each table (``accumulate`` micro-batches a step, weights from
    a parameter); the pooled outputs of every micro-batch, per table."""
    g = torch.Generator().manual_seed(seed)
    gains = [torch.linspace(0.5, 1.5, 5, dtype=torch.float64, requires_grad=True) for _ in tables]
    outs: list[list[torch.Tensor]] = [[] for _ in tables]
    rows = tables[0].num_embeddings
    for _ in range(steps):
        for _ in range(accumulate):
            ids = (torch.rand(32, 5, generator=g).pow(4) * rows).long()  # skewed: hot rows and a long tail
            w = torch.rand(32, 5, generator=g, dtype=torch.float64)
            for t, gain, out in zip(tables, gains, outs):
                weights = w * gain if t.mode == "sum" else None
                pooled = t(ids, per_sample_weights=weights)
                pooled.pow(2).sum().backward()
                out.append(pooled.detach())
        for t in tables:
            t.take_gradient()
            t.sparse_step()
    return outs, gains


@pytest.mark.parametrize("optimizer, mode", [("rowwise_adam", "sum"), ("rowwise_adagrad", "mean"),
                                             ("adagrad", "sum"), (SparseSGD(lr=0.2), "sum")])
def test_a_table_on_disk_trains_to_the_bits_of_the_table_in_memory(tmp_path, optimizer, mode):
    """A cache of 600 rows of 200,000 (misses and evictions every step; two micro-batches a step, whose slots stay
    pinned): every output, every row and every optimizer state equal the table in memory; the per-sample weights'
    gradients too; the whole table's state dict loads into nn.EmbeddingBag."""
    mem, disk = _twins(tmp_path, optimizer, cache_rows=600, mode=mode)
    (a, b), gains = _train([mem, disk], steps=12)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    if mode == "sum":
        assert torch.equal(gains[0].grad, gains[1].grad)
    assert disk.disk.misses > 3 * disk.disk.slots and disk.disk.writes > 0  # the cache turned over several times
    assert 0 < int(disk.disk.created.sum()) < disk.disk.created.numel() or disk.disk.created.numel() <= 4
    saved = disk.state_dict()["weight"]
    assert torch.equal(saved, mem.state_dict()["weight"])  # blocks no id reached: drawn as the table in memory has
    full, ref = disk.full_optimizer_state(), mem.full_optimizer_state()
    assert full.keys() == ref.keys() and all(torch.equal(full[k], ref[k]) for k in ref)
    plain = nn.EmbeddingBag(200_000, 4, mode=mode, dtype=torch.float64)
    plain.load_state_dict({"weight": saved}, strict=True)


def test_a_table_on_disk_resumes_from_its_state_into_another_cache(tmp_path):
    """Saved after 6 steps, loaded into a fresh table on disk with another cache size, 6 more steps: the table in
    memory that never stopped."""
    mem, disk = _twins(tmp_path / "a", "rowwise_adam", cache_rows=900)
    _train([mem, disk], steps=6)
    weight, state = disk.state_dict(), disk.full_optimizer_state()
    again = ShardedEmbeddingBag(200_000, 4, optimizer="rowwise_adam", init_seed=5, dtype=torch.float64,
                                rows_on_disk=tmp_path / "b", cache_rows=500)
    again.load_state_dict(weight)
    again.load_full_optimizer_state(state)
    (a, b), _ = _train([mem, again], steps=6, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(again.state_dict()["weight"], mem.state_dict()["weight"])


def test_a_cache_too_small_for_a_step_is_refused_naming_cache_rows(tmp_path):
    from lightning_horizon.embedding.disk import CacheTooSmall

    table = ShardedEmbeddingBag(1000, 4, init_seed=1, rows_on_disk=tmp_path, cache_rows=8)
    with pytest.raises(CacheTooSmall, match="cache_rows"):
        table(torch.arange(20).view(2, 10)).sum().backward()


def test_a_hashed_table_of_2_30_rows_costs_disk_only_where_ids_reach(tmp_path):
    """2^30 rows x 16 (64 GiB of rows, 4 GiB of row-wise Adagrad state) addressed by hashed ids: only the blocks
    the ids reach are drawn and written; the files stay sparse."""
    table = ShardedEmbeddingBag(2**30, 16, init_seed=3, rows_on_disk=tmp_path, cache_rows=4096)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 2**30, (64, 4), generator=g)
        table(ids).sum().backward()
        table.take_gradient()
        table.sparse_step(lr=0.1)
    assert table.disk.created.numel() == 2**30 // 65536 and int(table.disk.created.sum()) <= 3 * 64 * 4
    used = sum(os.stat(f).st_blocks * 512 for f in Path(table.disk.folder).glob("*.bin"))
    assert used < 3 * 64 * 4 * 65536 * 16 * 4 * 1.1  # the blocks drawn, nothing of the other 2^30 rows
    assert table.weight.shape == (4096, 16)  # in memory: the cache only


def test_bench_embedding_disk_smoke(tmp_path):
    """recipes/bench_embedding_disk.py --smoke: the memory and disk arms run and report, with the same loss."""
    out = tmp_path / "out.json"
    run_script(REPO / "recipes" / "bench_embedding_disk.py", ["--smoke", "--json", out], timeout=240)
    memory, disk = json.loads(out.read_text())
    assert (memory["arm"], disk["arm"]) == ("memory", "disk") and memory["steps"] == disk["steps"] == 3
    assert disk["loss"] == memory["loss"] and 0 < disk["hit_rate"] < 1 and disk["rows_read_per_step"] > 0


def test_a_table_on_disk_larger_than_the_free_disk_is_warned_at_placement(tmp_path, monkeypatch, caplog):
    import logging
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**20, 2**20))
    table = ShardedEmbeddingBag(2**20, 16, init_seed=3, rows_on_disk=tmp_path, cache_rows=1024)
    with caplog.at_level(logging.WARNING):
        table(torch.tensor([[1, 2]]))
    assert "take up to 0.1 GiB there, 0.0 GiB is free" in caplog.text and "a full disk ends the run" in caplog.text
