"""A 2-rank DDP run (gloo, CPU) through a spike and a NaN; every rank writes what GradNormBackoff decided.

Usage: python tests/scripts/backoff_fit.py OUT_DIR [MAX_STEPS] (Lightning's launcher re-executes this file for
rank 1), or ``main(OUT_DIR, MAX_STEPS)`` in each of 2 ranks forked after the imports (tests/launch.py's
``run_worlds``, as tests/test_grad_norm_backoff.py runs it). The spike is injected on rank 0 only and the NaN on
rank 1 only: both ranks must still decide alike. Writes OUT_DIR/rank{r}.json with, per optimizer step, the
callback's norm/scale/counters, the lrs the step used and a hash of the weights after the step.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_horizon.callbacks import GradNormBackoff
from lightning_horizon.callbacks.backoff_world import agree_across_ranks

SPIKE_AT = 3  # rank 0's loss x 1e6
NAN_AT = 6  # rank 1's loss x NaN


def weights_hash(module: nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class Net(L.LightningModule):
    def __init__(self, backoff: GradNormBackoff) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.backoff = backoff
        self.steps: list[dict] = []

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(1000 * self.global_rank + self.global_step)  # each rank its own data
        x = torch.randn(16, 8, generator=g)
        loss = F.mse_loss(self.net(x), torch.sin(x.sum(1, keepdim=True)))
        if self.global_step == SPIKE_AT and self.global_rank == 0:
            loss = loss * 1e6
        if self.global_step == NAN_AT and self.global_rank == 1:
            loss = loss * float("nan")
        return loss

    def on_before_optimizer_step(self, optimizer):  # after the callback's hook: lr scaled, grads clipped
        b = self.backoff
        self.steps.append(dict(step=self.global_step, grad_norm=b.last_grad_norm, lr_scale=b.lr_scale,
                               spikes=b.spikes, skipped=b.skipped_steps,
                               lrs=[g["lr"] for g in optimizer.param_groups]))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.steps[-1]["weights"] = weights_hash(self)
        self.steps[-1]["lr_after"] = self.trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_end(self):
        # the decision sync itself, fed rank-dependent local norms: every rank must get the same answer
        r = self.global_rank
        probes = [torch.tensor(1.0 + r), torch.tensor(float("nan") if r == 1 else 2.0),
                  torch.tensor(float("inf") if r == 0 else 3.0)]
        self.agreed = [agree_across_ranks(t)[0] for t in probes]

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(out_dir: str, max_steps: int = 10) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    backoff = GradNormBackoff(max_norm=1.0, spike_threshold=1e4, factor=0.8, recover_after=2)
    model = Net(backoff)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="horizon", max_steps=max_steps, callbacks=[backoff], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(out), use_distributed_sampler=False,
    )
    data = torch.utils.data.DataLoader(torch.arange(1000), batch_size=1)
    trainer.fit(model, data)
    result = dict(rank=trainer.global_rank, world_size=trainer.world_size, steps=model.steps,
                  agreed=model.agreed, state=backoff.state_dict())
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
