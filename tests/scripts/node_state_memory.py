"""One fit in fresh processes, for the node-sharded memory test: python node_state_memory.py STATE OUT_DIR (the tests
run it as the first fit of a tests/scripts/node_state_fit.py launch, whose later fits reuse the processes)

4 ranks on one node, an MLP of ~3.2M parameters (fp32, AdamW), 3 steps, 256 KiB buckets (the in-flight buffers,
a few buckets per rank, stay small beside the state). Each rank writes OUT_DIR/rank{R}.json with
its proportional set size (PSS: the node's one shared copy of the weights counts 1/4 on each rank) before the model
exists and the largest seen after backward and at each step's end, and its peak RSS (which counts shared pages
whole).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lightning_horizon import HorizonStrategy  # noqa: E402
from lightning_horizon.memory import current_pss, peak_rss  # noqa: E402

WIDTH, DEPTH_, BATCH = 256, 48, 8  # 3.2M parameters in 96 tensors of <= 256 KiB


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH_)])

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class PSS(L.Callback):
    def __init__(self, base: int) -> None:
        self.base, self.peak = base, base

    def _sample(self) -> None:
        self.peak = max(self.peak, current_pss())

    def on_after_backward(self, trainer, pl_module):
        self._sample()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._sample()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._sample()


def main(state: str, out: str) -> None:
    base = current_pss()
    torch.manual_seed(0)
    model = MLP()
    pss = PSS(base)
    trainer = L.Trainer(accelerator="cpu", devices=4, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[pss],
                        strategy=HorizonStrategy(state=state, threads_per_rank=1, bucket_size_mb=0.25, timeout=60))
    data = TensorDataset(torch.randn(4 * 3 * BATCH, WIDTH))
    trainer.fit(model, DataLoader(data, batch_size=BATCH))
    row = {"rank": trainer.global_rank, "base": base, "peak_pss": pss.peak, "peak_rss": peak_rss()}
    Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
