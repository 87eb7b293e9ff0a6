"""Lightning fits with HorizonStrategy(collectives=...): 4 ranks as 2 emulated nodes x 2, several fits per launch.

tests/test_collectives.py runs ``main(OUT_PREFIX, WORKDIR)`` in a world of 4 ranks forked from one launch
(tests/launch.run_worlds), with the variables Lightning's launcher gives its ranks; run as a script (``python
tests/scripts/collectives_fit.py OUT_PREFIX WORKDIR``), Lightning's launcher re-runs it for local ranks 1..3 and rank
0 sets LOCAL_RANK after the first launch. Either way the later fits reuse the same processes and process group.
Every rank writes OUT_PREFIX.rank{R}.json: ``{run name: {...what that rank saw...}}``.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_horizon import GradNormBackoff, HorizonStrategy
from lightning_horizon.gradnorm import total_norm_fp32

WORLD, PER_NODE, WIDTH = 4, 2, 32
STEPS_PER_EPOCH = 10
BUCKET_MB = (WIDTH * WIDTH + WIDTH) * 4 / 2**20  # one Linear(32, 32) per bucket: 4 equal buckets
NODE_SCALE, BACKOFF_MAX_NORM, BACKOFF_SPIKE = 1000.0, 1e-3, 10.0  # node 0's norms ~0.1, node 1's ~100


class Regression(L.LightningModule):
    """``node_scale``: node n's loss is scaled by ``node_scale ** n``; ``nan_at``: (step, rank) with a NaN loss."""

    def __init__(self, optimizer: str = "adam", node_scale: float = 1.0, nan_at: tuple = (-1, -1)):
        super().__init__()
        self.optimizer, self.node_scale, self.nan_at = optimizer, node_scale, tuple(nan_at)
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)])
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        if (self.global_step, self.global_rank) == self.nan_at:
            loss = loss * float("nan")
        return loss * self.node_scale ** (self.global_rank // PER_NODE)

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05)
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(WORLD * STEPS_PER_EPOCH * 8, WIDTH, generator=g)
    return TensorDataset(x, torch.sin(x.roll(1, dims=1)))


class Observe(L.Callback):
    """What the strategy holds while the model is still wrapped: the hook's name, the restored part state."""

    def __init__(self, info: dict) -> None:
        self.info = info

    def on_train_start(self, trainer, pl_module):
        model = trainer.strategy.model
        if hasattr(model, "_get_ddp_logging_data"):
            self.info["comm_hook"] = model._get_ddp_logging_data().get("comm_hook")
        part = getattr(trainer.strategy, "gradient_sync", None)
        if part is not None:
            self.info["state_at_start"] = summarize(part.state_dict())

    def on_train_end(self, trainer, pl_module):
        part = getattr(trainer.strategy, "gradient_sync", None)
        if part is not None:
            self.info["state_at_end"] = summarize(part.state_dict())
            self.info["metrics"] = part.comm_metrics()


class Norms(L.Callback):
    """Per optimizer step: this rank's pre-clip gradient norm and gradients (it runs before GradNormBackoff), and
    after the step the clipped norm, how far the clipped gradients are from torch's clip of the unclipped ones to
    ``backoff.max_norm`` (max |g - ref| / max |ref|; None without a max_norm or with a non-finite step), what the
    backoff decided, and whether the weights are finite."""

    def __init__(self, backoff: GradNormBackoff, rows: list) -> None:
        self.backoff, self.rows, self.norm, self.unclipped = backoff, rows, float("nan"), []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.norm = total_norm_fp32(params).item()
        self.unclipped = [p.grad.detach().clone() for p in params]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        params = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
        b = self.backoff
        self.rows.append(dict(norm=self.norm, clipped=total_norm_fp32(params).item(), world=b.last_grad_norm,
                              scale=b.lr_scale, skipped=b.skipped_steps, clip_error=self.clip_error(params),
                              finite=all(bool(torch.isfinite(p).all()) for p in params)))

    def clip_error(self, params: list) -> float | None:
        if self.backoff.max_norm is None or any(p.grad is None for p in params):
            return None
        ref = [nn.Parameter(torch.empty_like(g)) for g in self.unclipped]
        for r, g in zip(ref, self.unclipped):
            r.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(ref, self.backoff.max_norm)
        got, want = (torch.cat([t.reshape(-1) for t in ts]) for ts in ([p.grad for p in params], [r.grad for r in ref]))
        return ((got - want).abs().max() / want.abs().max()).item()


def summarize(state: dict) -> dict:
    """The part's state, JSON-sized: exact sums of the residuals instead of the tensors."""
    ef = state.get("error_feedback")
    residual = None
    if ef is not None:
        residual = {k: [float(v.double().sum()), float(v.double().abs().sum())] for k, v in ef["residual"].items()}
    return {"periodic": state.get("periodic"), "residual": residual}


def fit(name: str, results: dict, workdir: Path, epochs: int, ckpt_in=None, ckpt_out=None, ddp=False,
        optimizer="adam", model_kw=None, backoff=None, **kw):
    L.seed_everything(0, verbose=False)
    model = Regression(optimizer, **(model_kw or {}))
    if ddp:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(bucket_cap_mb=BUCKET_MB)
    else:
        strategy = HorizonStrategy(ranks_per_node=PER_NODE, bucket_size_mb=BUCKET_MB, threads_per_rank=1, **kw)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(workdir),
    )
    info: dict = {}
    trainer.callbacks.append(Observe(info))
    if backoff is not None:
        info["steps"] = []
        trainer.callbacks += [Norms(backoff, info["steps"]), backoff]
    trainer.fit(model, DataLoader(dataset(), batch_size=8), ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    info.update(losses=model.losses, global_step=trainer.global_step, rank=trainer.global_rank)
    results[name] = info
    return trainer


def main(out_prefix: str, workdir: str) -> None:
    work = Path(workdir)
    results: dict = {}
    epochs = 50 // STEPS_PER_EPOCH  # 50 steps
    fit("ddp", results, work, epochs, ddp=True)
    for algorithm in ("flat", "hierarchical", "torus2d"):
        fit(algorithm, results, work, epochs, collectives=algorithm)
    fit("auto", results, work, 1, collectives="auto")  # probes the links at setup

    # Resume: error feedback (int8) and local-SGD counters. Local SGD runs plain SGD, whose state is nothing, and
    # a sync falls on step 10, the checkpoint step: every node then holds what rank 0 saved, and the resumed
    # run can match the whole one. (Adam's moments differ between nodes and only rank 0's are saved.)
    resumable = {
        "int8": dict(collectives="hierarchical", compression="int8"),
        "local_sgd": dict(collectives="hierarchical", sync_every=4, sync_warmup_steps=6, optimizer="sgd"),
    }
    for tag, kw in resumable.items():
        ckpt = str(work / f"{tag}.ckpt")
        fit(f"{tag}_whole", results, work, 2, **kw)
        fit(f"{tag}_first", results, work, 1, ckpt_out=ckpt, **kw)
        fit(f"{tag}_resumed", results, work, 2, ckpt_in=ckpt, **kw)

    # GradNormBackoff under local SGD: node 1's loss is NODE_SCALE x node 0's, and max_norm clips both nodes,
    # each by its own norm; a spike on node 1 backs the lr off on every rank.
    fit("backoff_local_sgd", results, work, 1, optimizer="sgd", model_kw=dict(node_scale=NODE_SCALE),
        backoff=GradNormBackoff(max_norm=BACKOFF_MAX_NORM, spike_threshold=BACKOFF_SPIKE),
        collectives="hierarchical", sync_every=2, sync_warmup_steps=0)
    # int8 with error feedback through a NaN on rank 1 at step 3: skipped, and the run goes on finite.
    fit("int8_nan", results, work, 1, model_kw=dict(nan_at=(3, 1)), backoff=GradNormBackoff(max_norm=1.0),
        collectives="hierarchical", compression="int8")
    rank = results["ddp"]["rank"]
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
