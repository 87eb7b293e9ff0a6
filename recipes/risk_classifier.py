"""Financial-risk classification in small: dense features plus high-cardinality ids through a hashed embedding.

    python recipes/risk_classifier.py                      # embedded data with a known signal, a minute or so
    python recipes/risk_classifier.py fit --data.csv_path rows.csv --data.id_columns '[merchant, device]'
    python recipes/risk_classifier.py fit --trainer.devices 4 --model.num_buckets 20000000  # 20M rows over 4 ranks

The embedded generator draws rows whose default probability is known exactly, so the best achievable AUROC
(the "oracle": the true probabilities ranked against the labels) is printed next to the model's and the target
(AUROC >= 0.85) means something. The signal: a linear term and one interaction on 8 dense features, a per-merchant
risk (10% of ~200k merchants are risky; merchants follow a Zipf law, as in card data, so the frequent
ones can be learnt) and a per-region offset; device ids are pure noise with a million values (the embedding has to
learn to ignore them).

High-cardinality ids are never given a row each: every id is hashed ``num_hashes`` times into ``num_buckets``
shared rows whose vectors are summed (the hashing trick with multiple hashes, as in Bloom embeddings): memory is
``num_buckets x dim`` whatever the cardinality, and two ids collide on all hashes only rarely. The table is a
ShardedEmbeddingBag (``--model.table sharded``, the default; docs/embedding.md): under HorizonStrategy with several
ranks its rows are spread over them, a step moves and updates only the rows its batch touched (row-wise Adagrad at
``--model.table_lr``), and the MLP stays data parallel under AdamW. ``--model.table dense`` is the replicated
``nn.Embedding`` that AdamW updates whole.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC
from torchmetrics.functional.classification import binary_auroc

from lightning_horizon import GradNormBackoff
from lightning_horizon.embedding import RowWiseAdagrad, ShardedEmbeddingBag

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import FitByDefaultParser, csv_logger_under, drop_unset_ddp_args, horizon_precision_default  # noqa: E402

N_DENSE = 8
TABLES = ("sharded", "dense")
ID_FIELDS = ("merchant", "region", "device")
_CARDINALITY = {"merchant": 200_000, "region": 1_000, "device": 1_000_000}


# ---------------------------------------------------------------------------------------------- data


def _unit_hash(ids: np.ndarray, salt: int) -> np.ndarray:
    """A deterministic uniform [0, 1) value per id (splitmix64): per-id effects without a table of them."""
    with np.errstate(over="ignore"):  # uint64 wrap-around is the point
        z = ids.astype(np.uint64) + np.uint64(salt) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53)


def generate(n_rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Rows with dense features, ids, the true default probability ``p`` and a label drawn from it."""
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((n_rows, N_DENSE)).astype(np.float32)
    # Zipf-distributed merchants (a few are very frequent), uniform regions and devices
    merchant = np.minimum(rng.zipf(1.2, n_rows) - 1, _CARDINALITY["merchant"] - 1).astype(np.int64)
    merchant = (merchant * 2654435761) % _CARDINALITY["merchant"]  # frequent merchants are not ids 0, 1, 2...
    region = rng.integers(0, _CARDINALITY["region"], n_rows)
    device = rng.integers(0, _CARDINALITY["device"], n_rows)
    w = np.array([1.4, -1.0, 0.8, 0.6, -0.4, 0.3, 0.0, 0.0])  # the last two dense features carry nothing
    logit = -3.0 + dense @ w + 0.8 * dense[:, 0] * dense[:, 1]
    logit += np.where(_unit_hash(merchant, 1) < 0.10, 3.5, 0.0)  # 10% of merchants are risky
    logit += 1.5 * (_unit_hash(region, 2) - 0.5)
    p = 1 / (1 + np.exp(-logit))
    y = (rng.random(n_rows) < p).astype(np.float32)
    return {"dense": dense, "ids": np.stack([merchant, region, device], 1), "p": p, "y": y}


class RiskDataModule(L.LightningDataModule):
    """The embedded generator's rows, or a CSV file's.

    Args:
        csv_path: a CSV with a header; ``None`` uses the embedded generator.
        label_column: the CSV's 0/1 label column.
        id_columns: the CSV's id columns (any hashable text or integer); every other column is a dense feature.
        n_rows: rows to generate (embedded data only).
        val_fraction: share of rows held out for validation (the last rows after a seeded shuffle).
        batch_size: rows per batch.
        seed: seed of the generator and of the split.
        min_id_count: ids seen fewer times than this in the training rows become one "rare" id per field (as CTR
            pipelines threshold Criteo's ids): an id seen once can only be memorized, and a model that memorizes
            a million one-off device ids overfits within an epoch. 1 keeps every id.
    """

    def __init__(self, csv_path: Optional[str] = None, label_column: str = "label",
                 id_columns: Optional[list[str]] = None, n_rows: int = 100_000, val_fraction: float = 0.2,
                 batch_size: int = 512, seed: int = 0, min_id_count: int = 5) -> None:
        super().__init__()
        if csv_path is not None and not Path(csv_path).is_file():
            raise ValueError(f"RiskDataModule(csv_path={csv_path!r}): no such file (or None for the embedded data)")
        if isinstance(n_rows, bool) or not isinstance(n_rows, int) or n_rows < 100:
            raise ValueError(f"RiskDataModule(n_rows={n_rows!r}): allowed is an int >= 100")
        if not 0 < val_fraction < 1:
            raise ValueError(f"RiskDataModule(val_fraction={val_fraction!r}): allowed is a number in (0, 1)")
        self.csv_path, self.label_column, self.id_columns = csv_path, label_column, list(id_columns or [])
        if isinstance(min_id_count, bool) or not isinstance(min_id_count, int) or min_id_count < 1:
            raise ValueError(f"RiskDataModule(min_id_count={min_id_count!r}): allowed is an int >= 1")
        self.n_rows, self.val_fraction, self.batch_size, self.seed = n_rows, val_fraction, batch_size, seed
        self.min_id_count = min_id_count
        self.n_dense, self.n_ids = N_DENSE, len(ID_FIELDS)
        self.oracle_auroc: Optional[float] = None
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    def _load(self) -> dict[str, np.ndarray]:
        if self.csv_path is None:
            return generate(self.n_rows, self.seed)
        import csv

        with open(self.csv_path, newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows or self.label_column not in rows[0]:
            raise ValueError(f"RiskDataModule(label_column={self.label_column!r}): not a column of {self.csv_path}")
        missing = [c for c in self.id_columns if c not in rows[0]]
        if missing:
            raise ValueError(f"RiskDataModule(id_columns={self.id_columns!r}): {missing} not in {self.csv_path}")
        dense_cols = [c for c in rows[0] if c != self.label_column and c not in self.id_columns]
        # ids as text -> a stable 62-bit integer (Python's hash() is salted per process: ranks would disagree)
        ids = np.array([[int.from_bytes(hashlib.blake2b(str(r[c]).encode(), digest_size=8).digest(), "little") >> 2
                         for c in self.id_columns] for r in rows], dtype=np.int64).reshape(len(rows), -1)
        dense = np.array([[float(r[c] or 0.0) for c in dense_cols] for r in rows], dtype=np.float32)
        dense = (dense - dense.mean(0)) / (dense.std(0) + 1e-6)  # standardized: the MLP has no input norm
        y = np.array([float(r[self.label_column]) for r in rows], dtype=np.float32)
        return {"dense": dense.reshape(len(rows), -1), "ids": ids, "y": y}

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        d = self._load()
        n = len(d["y"])
        self.n_dense, self.n_ids = d["dense"].shape[1], d["ids"].shape[1]
        order = np.random.default_rng(self.seed + 1).permutation(n)
        n_val = max(1, int(n * self.val_fraction))
        train, val = order[:-n_val], order[-n_val:]
        if "p" in d:
            self.oracle_auroc = float(binary_auroc(torch.from_numpy(d["p"][val]), torch.from_numpy(d["y"][val]).long()))
        if self.min_id_count > 1:  # counted on the training rows only: validation must not leak into the vocabulary
            ids = d["ids"].copy()
            for j in range(ids.shape[1]):
                uniq, inverse = np.unique(ids[:, j], return_inverse=True)
                seen = np.zeros(len(uniq), dtype=np.int64)
                np.add.at(seen, inverse[train], 1)
                ids[seen[inverse] < self.min_id_count, j] = -1  # the field's "rare" id
            d["ids"] = ids
        tensors = [torch.from_numpy(np.ascontiguousarray(d[k])) for k in ("dense", "ids", "y")]
        self.train_set = TensorDataset(*(t[train] for t in tensors))
        self.val_set = TensorDataset(*(t[val] for t in tensors))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=4 * self.batch_size)


# ---------------------------------------------------------------------------------------------- model


class HashedEmbedding(nn.Module):
    """Ids of ``n_fields`` fields -> ``(batch, n_fields, dim)``: each id hashed ``num_hashes`` times into
    ``num_buckets`` shared rows (a different hash family per field), the rows summed.

    ``table="sharded"``: the rows in a ShardedEmbeddingBag (docs/embedding.md), spread over the ranks under
    HorizonStrategy and stepped sparsely by row-wise Adagrad at ``table_lr``; ``"dense"``: an ``nn.Embedding`` every
    rank holds whole, stepped densely by the model's AdamW."""

    def __init__(self, n_fields: int, num_buckets: int, dim: int, num_hashes: int = 2, seed: int = 0,
                 table: str = "sharded", table_lr: float = 0.02) -> None:
        super().__init__()
        if num_buckets < 2 or num_hashes < 1 or dim < 1:
            raise ValueError(f"HashedEmbedding(num_buckets={num_buckets}, dim={dim}, num_hashes={num_hashes}): allowed"
                             " are num_buckets >= 2, dim >= 1, num_hashes >= 1")
        if table not in TABLES:
            raise ValueError(f"HashedEmbedding(table={table!r}): allowed is one of {TABLES}")
        self.num_buckets, self.sharded = num_buckets, table == "sharded"
        if self.sharded:  # each rank draws only the rows it holds (init_seed)
            self.table = ShardedEmbeddingBag(num_buckets, dim, mode="sum", optimizer=RowWiseAdagrad(lr=table_lr),
                                             init_std=0.05, init_seed=seed)
        else:
            self.table = nn.Embedding(num_buckets, dim)
            nn.init.normal_(self.table.weight, std=0.05)
        g = torch.Generator().manual_seed(seed)
        # odd multipliers and random offsets, one pair per (field, hash): multiply-shift-style universal hashing
        self.register_buffer("mul", torch.randint(1, 2**31 - 1, (n_fields, num_hashes), generator=g) * 2 + 1,
                             persistent=True)
        self.register_buffer("add", torch.randint(0, 2**31 - 1, (n_fields, num_hashes), generator=g), persistent=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = ids[:, :, None] * self.mul + self.add  # int64 wrap-around is part of the hash
        h = torch.remainder(h ^ (h >> 29), self.num_buckets)
        if self.sharded:  # one bag per (sample, field): its hashes' rows summed
            return self.table(h.flatten(0, 1)).view(*h.shape[:2], -1)
        return self.table(h).sum(2)


class RiskModel(L.LightningModule):
    """An MLP over standardized dense features and hashed id embeddings; BCE loss; AUROC and accuracy.

    Args:
        n_dense: dense features (the data module's count is used when it differs).
        n_ids: id fields.
        num_buckets: rows of the shared hashed-embedding table.
        embed_dim: embedding width per id field.
        num_hashes: hashes per id.
        hidden: MLP hidden widths.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        table: ``"sharded"`` (rows spread over the ranks, row-wise Adagrad on the rows a batch touches) or
            ``"dense"`` (every rank holds the table; AdamW steps every row).
        table_lr: row-wise Adagrad's learning rate (``table="sharded"``).
    """

    def __init__(self, n_dense: int = N_DENSE, n_ids: int = len(ID_FIELDS), num_buckets: int = 2**16,
                 embed_dim: int = 16, num_hashes: int = 2, hidden: tuple[int, ...] = (128, 64), lr: float = 3e-3,
                 weight_decay: float = 1e-5, table: str = "sharded", table_lr: float = 0.02) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = HashedEmbedding(n_ids, num_buckets, embed_dim, num_hashes, table=table, table_lr=table_lr)
        layers: list[nn.Module] = []
        width = n_dense + n_ids * embed_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.GELU()]
            width = h
        self.mlp = nn.Sequential(*layers, nn.Linear(width, 1))
        self.val_auroc, self.val_acc = BinaryAUROC(), BinaryAccuracy()

    def setup(self, stage: str) -> None:
        dm = self.trainer.datamodule if self.trainer is not None else None
        if dm is not None and (dm.n_dense, dm.n_ids) != (self.hparams.n_dense, self.hparams.n_ids):
            raise ValueError(f"RiskModel(n_dense={self.hparams.n_dense}, n_ids={self.hparams.n_ids}): the data has"
                             f" {dm.n_dense} dense features and {dm.n_ids} id columns; pass --model.n_dense"
                             f" {dm.n_dense} --model.n_ids {dm.n_ids}")

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = torch.cat([dense, self.embed(ids).flatten(1)], 1)
        return self.mlp(x).squeeze(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        dense, ids, y = batch
        loss = F.binary_cross_entropy_with_logits(self(dense, ids).float(), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        dense, ids, y = batch
        logits = self(dense, ids).float()
        self.val_auroc.update(logits.sigmoid(), y.long())
        self.val_acc.update(logits.sigmoid(), y.long())
        self.log("val_loss", F.binary_cross_entropy_with_logits(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_auroc", self.val_auroc, prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay,
                                 fused=True)

    def on_fit_end(self) -> None:
        if self.trainer.global_rank != 0:
            return
        m, dm = self.trainer.callback_metrics, self.trainer.datamodule
        if "val_auroc" in m:
            oracle = f" (oracle AUROC of the true probabilities: {dm.oracle_auroc:.4f})" if dm.oracle_auroc else ""
            print(f"\n=== risk classifier ===\nval AUROC {float(m['val_auroc']):.4f}{oracle} | val accuracy"
                  f" {float(m['val_acc']):.4f} | target AUROC >= 0.85: {'met' if m['val_auroc'] >= 0.85 else 'NOT met'}",
                  flush=True)


TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "strategy": {"class_path": "lightning_horizon.HorizonStrategy"},
    "plugins": horizon_precision_default(),
    "max_epochs": 2,
    "log_every_n_steps": 10,
    "num_sanity_val_steps": 0,
    "default_root_dir": "runs/risk_classifier",
    "enable_checkpointing": False,
}


class RiskCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(GradNormBackoff, "backoff")  # always on, configurable as --backoff.*

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        drop_unset_ddp_args(cfg.trainer.strategy)
        csv_logger_under(cfg, cfg.trainer.default_root_dir)  # CSV logs under the run's directory


def main(args: Optional[list[str]] = None) -> LightningCLI:
    """Parse ``args`` (``None``: the command line; no subcommand: ``fit``), then train and report."""
    return RiskCLI(RiskModel, RiskDataModule, trainer_defaults=TRAINER_DEFAULTS, seed_everything_default=7,
                   save_config_kwargs={"overwrite": True}, parser_class=FitByDefaultParser, args=args)


if __name__ == "__main__":
    main()
