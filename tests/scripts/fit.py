"""Run one or more small fits described by a JSON file, and write what each rank saw to JSON.

usage: python fit.py CONFIG.json OUT_PREFIX

CONFIG holds {"runs": [{...}, ...]}; each run names a strategy ("ddp" for Lightning's own, "horizon" for ours),
its kwargs, devices, num_nodes and the training variant. Lightning's launcher re-executes this script for the
other local ranks, so every rank runs the same runs in the same order; each writes OUT_PREFIX.rank{R}.json.
The tests start it with :func:`launch`, or fork every rank from one process with :func:`launch_forked`.
"""

import json
import os
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_horizon import HorizonStrategy


class TinyLM(L.LightningModule):
    """A next-token MLP on random tokens: embedding, two hidden layers, a head; several DDP buckets."""

    def __init__(self, manual=False, two_optimizers=False, scheduler=None, vocab=64, dim=32):
        super().__init__()
        self.automatic_optimization = not manual
        self.two_optimizers, self.scheduler = two_optimizers, scheduler
        self.emb = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, dim))
        self.head = nn.Linear(dim, vocab)
        self.losses, self.lrs = [], []

    def forward(self, x):
        return self.head(self.body(self.emb(x)))

    def _loss(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(loss.item())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
        return None

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        if self.two_optimizers:
            a = torch.optim.SGD(list(self.emb.parameters()) + list(self.head.parameters()), lr=0.1)
            b = torch.optim.AdamW(self.body.parameters(), lr=1e-2)
            return [a, b]
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        if self.scheduler == "cosine":
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        return opt


class _RecordCommHook(L.Callback):
    """The comm hook DDP reports, read while the model is still wrapped (teardown unwraps it)."""

    def __init__(self, info):
        self.info = info

    def on_train_start(self, trainer, pl_module):
        model = trainer.strategy.model
        if hasattr(model, "_get_ddp_logging_data"):
            self.info["comm_hook"] = model._get_ddp_logging_data().get("comm_hook")


def data(n=256, vocab=64, seed=1234):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n,), generator=g)
    y = (x * 7 + 3) % vocab  # a learnable mapping: the loss must fall
    return TensorDataset(x, y)


def make_strategy(run):
    kwargs = dict(run.get("strategy_kwargs", {}))
    if kwargs.pop("allreduce_hook", False):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        kwargs["ddp_comm_hook"] = default_hooks.allreduce_hook
    if run["strategy"] == "horizon":
        return HorizonStrategy(**kwargs) if kwargs else "horizon"
    return run["strategy"]


def main(config_path, out_prefix):
    runs = json.load(open(config_path))["runs"]
    results = []
    for run in runs:
        L.seed_everything(run.get("seed", 7), verbose=False)
        model = TinyLM(manual=run.get("manual", False), two_optimizers=run.get("two_optimizers", False),
                       scheduler=run.get("scheduler"))
        trainer = L.Trainer(
            accelerator="cpu", devices=run.get("devices", 1), num_nodes=run.get("num_nodes", 1),
            strategy=make_strategy(run), max_steps=run.get("max_steps", 8), max_epochs=run.get("max_epochs", 1),
            accumulate_grad_batches=run.get("accumulate", 1), logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            limit_val_batches=2, default_root_dir=run.get("root", "/tmp/horizon_fit"),
        )
        loader = DataLoader(data(), batch_size=16)
        info = {"name": run["name"]}
        trainer.callbacks.append(_RecordCommHook(info))
        trainer.fit(model, loader, loader if run.get("validate_during_fit") else None)
        strategy = trainer.strategy
        if run.get("evaluate"):
            info["validate"] = trainer.validate(model, loader, verbose=False)
            info["test"] = trainer.test(model, loader, verbose=False)
            info["predict_batches"] = len(trainer.predict(model, loader))
        if isinstance(strategy, HorizonStrategy):
            pg = strategy.process_groups
            info.update(
                placement=strategy.placement, intra_ranks=pg.intra_ranks, inter_ranks=pg.inter_ranks,
                backend=strategy.process_group_backend, table=strategy.startup_table() if strategy.placement else "",
                threads=torch.get_num_threads(),
            )
        info.update(losses=model.losses, lrs=model.lrs, rank=trainer.global_rank, world=trainer.world_size,
                    global_step=trainer.global_step,
                    param_sum=float(sum(p.detach().double().sum() for p in model.parameters())))
        results.append(info)
    rank = results[-1]["rank"] if results else 0
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump(results, f)


def launch(tmp_path, runs, *, nodes=1, tasksets=None, timeout=240):
    """Run ``runs`` through this script under Lightning's launcher (``nodes`` > 1: one process tree per emulated
    node, started with NODE_RANK as on a cluster; ``tasksets``: a command prefix per node) and return
    ``{run name: {rank: what that rank saw}}``. For the tests; a hang is killed at ``timeout``."""
    import socket

    from tests.launch import run_script, run_scripts

    script = os.path.abspath(__file__)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"runs": runs}))
    prefix = tmp_path / "out"
    if nodes == 1:
        run_script(script, [cfg, prefix], timeout=timeout)
    else:
        with socket.socket() as s:  # a free port for the rendezvous of the node trees
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = lambda n: {"NODE_RANK": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # noqa: E731
        run_scripts([(script, [cfg, prefix], env(n)) for n in range(nodes)], timeout=timeout, prefixes=tasksets)
    return _results(tmp_path)


def launch_forked(tmp_path, runs, *, nodes, devices, tasksets=None, timeout=240):
    """As :func:`launch` with ``nodes`` launches (one per emulated node, started with NODE_RANK as on a cluster;
    ``tasksets``: a command prefix per node), but each node's launch forks its ``devices`` ranks after its imports
    (tests/scripts/forked_worlds.py) with the variables Lightning's launcher gives the ranks it starts (LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR/PORT; one OpenMP thread: its cores // processes here), so that Lightning starts none."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    from tests.launch import FORKED_WORLDS, run_scripts

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"runs": runs}))
    port, launches = find_free_network_port(), []
    for n in range(nodes):
        work = tmp_path / f"node{n}"
        work.mkdir()
        ranks = [{"call": "tests.scripts.fit:main", "args": [str(cfg), str(tmp_path / "out")],
                  "env": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": n, "LOCAL_RANK": r,
                          "WORLD_SIZE": nodes * devices, "OMP_NUM_THREADS": 1}} for r in range(devices)]
        (work / "jobs.json").write_text(json.dumps({"jobs": [{"tag": "ranks", "processes": ranks}]}))
        launches.append((FORKED_WORLDS, [work / "jobs.json", work], None))
    outs = run_scripts(launches, timeout=timeout, prefixes=tasksets)
    for n, out in enumerate(outs):
        exits = [json.loads(line)["exit"] for line in (tmp_path / f"node{n}" / "exits.jsonl").read_text().splitlines()]
        assert exits == [[0] * devices], f"node {n}'s ranks exited {exits}:\n{out.stdout[-6000:]}"
    return _results(tmp_path)


def _results(tmp_path):
    results = {}
    for path in sorted(tmp_path.glob("out.rank*.json")):
        for info in json.loads(path.read_text()):
            results.setdefault(info["name"], {})[info["rank"]] = info
    return results


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
