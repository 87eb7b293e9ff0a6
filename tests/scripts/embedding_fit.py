"""The fits of tests/test_embedding.py, one launch per world size: python embedding_fit.py CONFIG.json OUT_DIR

CONFIG: {"world": W, "runs": [{...}, ...]}; every rank runs them in order in the same processes (Lightning's
launcher re-executes this script for the other ranks). A run is

    {"name": ..., "optimizer": "sgd"|"adagrad"|"rowwise_adagrad"|"rowwise_adam", "dense": "SGD"|"AdamW",
     "mode": "sum"|"mean", "clip": null|"backoff"|"trainer-norm", "steps": N, "resume_from": PATH|null,
     "weights": false|true|"trainable" (per_sample_weights: the data's, or the data's times a parameter),
     "precision": "64-true"|"bf16-mixed", "epoch_steps": steps per epoch,
     "span": "auto"|"world"|"node" (every table's), "rpn": ranks per emulated node,
     "links": null|name of LINKS (HorizonStrategy's cost_model: what span="auto" prices the layouts with),
     "sharding": null|HorizonStrategy's sharding= (its profile runs the first step's forward once more),
     "disk": null|cache_rows (the tables seeded, their rows on disk under OUT_DIR/tables, that many of the big
     one's in memory, all of a small one's)}

The model (:class:`Risk`): a row-sharded ShardedEmbeddingBag (ROWS x DIM), two small table-wise ones (SMALL) and a
Linear head, a BCE loss; the data
(:func:`dataset`) gives step k's ranks, together, samples ``[k * W * BATCH, (k + 1) * W * BATCH)``. Rank 0 writes
OUT_DIR/NAME.pt: the losses per step (the mean over the ranks), ``trainer.save_checkpoint`` after fit
(OUT_DIR/NAME.ckpt), the validation loss after fit and how rank 0 holds the tables (its rows of the big one, its
copies, the small ones' owners); a failure writes its traceback there instead.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lightning_horizon import GradNormBackoff, HorizonPrecision, HorizonStrategy  # noqa: E402
from lightning_horizon.embedding import ShardedEmbeddingBag, SparseSGD  # noqa: E402

ROWS, DIM, BAG, BATCH = 37, 4, 3, 4  # 37 rows: the last rank's share is smaller
SMALL = (7, 5)  # the rows of the two table-wise tables
CLIP = 0.05
#: link constants (alpha s, beta s/byte) for span="auto": a slow link between the nodes (a copy per node costs
#: less), and links where latency is all (spread over the world sends fewer rounds of messages)
LINKS = {"slow-inter": {"intra": (1e-5, 1e-9), "inter": (1e-5, 1e-6)},
         "latency": {"intra": (1e-3, 1e-12), "inter": (1e-3, 1e-12)}}


def dataset(samples: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ROWS, (samples, BAG), generator=g)
    ids[:, 0] = torch.randint(0, 6, (samples,), generator=g)  # hot rows, touched by every rank
    weights = torch.rand(samples, BAG, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 2, (samples,), generator=g).to(torch.float64)
    return TensorDataset(ids, weights, labels)


class Risk(L.LightningModule):
    def __init__(self, optimizer: str = "sgd", dense: str = "SGD", mode: str = "sum", weighted: object = False,
                 dtype: torch.dtype = torch.float64, span: str = "world", seeded: bool = False,
                 rows_on_disk: object = None, cache_rows: object = None) -> None:
        super().__init__()
        # SGD at the dense optimizer's lr: the run equals plain nn.EmbeddingBag + torch.optim.SGD
        table_opt = SparseSGD(lr=0.5) if optimizer == "sgd" else optimizer
        self.emb = ShardedEmbeddingBag(ROWS, DIM, mode=mode, optimizer=table_opt, dtype=dtype, span=span,
                                       init_seed=3 if seeded else None, rows_on_disk=rows_on_disk,
                                       cache_rows=cache_rows)
        # two small tables, each whole on one rank (placement="table": ranks 0 and 1), of the ids modulo their size
        self.smalls = nn.ModuleList([ShardedEmbeddingBag(n, DIM, mode=mode, optimizer=table_opt, dtype=dtype,
                                                         placement="table", span=span,
                                                         init_seed=4 + i if seeded else None,
                                                         rows_on_disk=rows_on_disk,
                                                         cache_rows=n if rows_on_disk else None)
                                     for i, n in enumerate(SMALL)])
        self.head = nn.Linear(DIM, 1, dtype=dtype)
        self.dense, self.weighted = dense, weighted
        if weighted == "trainable":  # per-sample weights that get a gradient: the data's, times a gain per position
            self.gain = nn.Parameter(torch.linspace(0.5, 1.5, BAG, dtype=dtype))
        self.losses: list[float] = []

    def loss(self, batch) -> torch.Tensor:
        ids, weights, labels = batch
        weights = weights.to(self.emb.weight.dtype)
        if self.weighted == "trainable":
            weights = weights * self.gain
        pooled = self.emb(ids, per_sample_weights=weights if self.weighted else None)
        for n, small in zip(SMALL, self.smalls):
            pooled = pooled + small(ids % n)
        logits = self.head(pooled).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits.to(labels.dtype), labels)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def train_dataloader(self):
        # in order (Lightning's own sampler shuffles training data): step k's ranks together take samples
        # [k * W * BATCH, (k + 1) * W * BATCH), what the single-process reference takes
        sampler = DistributedSampler(self.data, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(self.data, batch_size=BATCH, sampler=sampler)

    def configure_optimizers(self):
        if self.dense == "AdamW":
            return torch.optim.AdamW(self.parameters(), lr=0.05)
        return torch.optim.SGD(self.parameters(), lr=0.5)


def run(cfg: dict, world: int, out: Path) -> None:
    torch.manual_seed(0)
    dtype = torch.float64 if cfg.get("precision", "64-true") == "64-true" else torch.float32
    disk = cfg.get("disk")
    model = Risk(cfg["optimizer"], cfg.get("dense", "SGD"), cfg.get("mode", "sum"), cfg.get("weights", False), dtype,
                 cfg.get("span", "world"), seeded=disk is not None,
                 rows_on_disk=str(out / "tables") if disk else None, cache_rows=disk)
    steps = cfg["steps"]
    model.data = dataset(world * BATCH * cfg.get("epoch_steps", steps))
    callbacks = [GradNormBackoff(max_norm=CLIP, spike_threshold=None)] if cfg.get("clip") == "backoff" else []
    extra = {"gradient_clip_val": CLIP} if cfg.get("clip") == "trainer-norm" else {}
    precision = {"precision": "64-true"} if dtype == torch.float64 else {"plugins": [HorizonPrecision("bf16-mixed")]}
    strategy = HorizonStrategy(ranks_per_node=cfg.get("rpn"), cost_model=LINKS.get(cfg.get("links")),
                               sharding=cfg.get("sharding"))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
        max_epochs=-1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=callbacks,
        default_root_dir=str(out / "root"), **precision, **extra,
    )
    trainer.fit(model, ckpt_path=cfg.get("resume_from"))
    trainer.save_checkpoint(out / f"{cfg['name']}.ckpt")
    val_data = dataset(world * BATCH * 2, seed=2)
    sampler = DistributedSampler(val_data, world, trainer.global_rank, shuffle=False)
    val = trainer.validate(model, DataLoader(val_data, batch_size=BATCH, sampler=sampler), verbose=False)
    if trainer.global_rank == 0:
        torch.save({"losses": model.losses, "val_loss": val[0]["val_loss"], "rows": model.emb.rows,
                    "copies": model.emb.copies, "owners": [s.owner for s in model.smalls]}, out / f"{cfg['name']}.pt")


def main(config: str, out_dir: str) -> None:
    cfg = json.loads(Path(config).read_text())
    out = Path(out_dir)
    for r in cfg["runs"]:
        try:
            run(r, cfg["world"], out)
        except Exception:
            (out / f"{r['name']}.error").write_text(traceback.format_exc())
            raise


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
