"""A tiny fit under torchrun that a fault may interrupt: python -m torch.distributed.run ... recover_fit.py CONFIG_JSON

CONFIG: {"out": DIR, "steps": N, "samples": S, "every": K (checkpoint every K steps), "fault": null | "kill" |
"stop" | "term", "victim": rank, "at": step (0-based global step of the fault, first attempt only), "heartbeat": s,
"background": bool}. ``kill`` SIGKILLs the victim in the forward of step ``at`` (torchrun restarts the group),
``stop`` SIGSTOPs it there (the heartbeat ends the job with exit 75; torchrun restarts it), ``term`` has the victim
send SIGTERM to torchrun's agent (a preemption: the agent forwards it to every rank and ends without a restart).
Every attempt resumes from ``ckpt_path="last"``. Each rank appends ``{"attempt", "step", "rank"}`` per trained step to
DIR/steps.jsonl; rank 0 writes the final parameters to DIR/final.pt (not after a SIGTERM: Lightning ends the process).
``unprefixed``: the rendezvous store used as before attempts had their own keys (the control arm of
recipes/bench_faults.py's restart tries).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lightning_horizon import AtomicCheckpointIO, HorizonStrategy, PreemptionCheckpoint  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Net(L.LightningModule):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        cfg = self.cfg
        if (cfg.get("fault") and ATTEMPT == 0 and self.global_rank == cfg["victim"] and self.global_step == cfg["at"]
                and not (Path(cfg["out"]) / "faulted").exists()):
            (Path(cfg["out"]) / "faulted").write_text(str(self.global_step))
            print(f"rank {self.global_rank}: fault {cfg['fault']} at step {self.global_step}", flush=True)
            if cfg["fault"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif cfg["fault"] == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                os.kill(os.getppid(), signal.SIGTERM)  # torchrun's agent: it forwards SIGTERM to every rank
        with open(Path(cfg["out"]) / "steps.jsonl", "a") as f:
            f.write(json.dumps({"attempt": ATTEMPT, "step": self.global_step, "rank": self.global_rank}) + "\n")
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 5, 0.7),
                                                   "interval": "step"}}


def main(cfg: dict) -> None:
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if cfg.get("unprefixed"):  # the store as before the fix (the bench's control arm): every attempt's keys unprefixed
        from lightning_horizon import placement

        placement.agent_store_kept = lambda: False
        placement.attempt_prefix = lambda: ""
    L.seed_everything(7, verbose=False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(cfg["samples"], 16, generator=g)
    data = TensorDataset(x, (x[:, :4] * 3).argmax(1))
    model = Net(cfg)
    preempt = PreemptionCheckpoint()
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", save_last=True, every_n_train_steps=cfg["every"], save_top_k=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=HorizonStrategy(threads_per_rank=1, timeout=60, heartbeat_timeout=cfg.get("heartbeat", 30),
                                 checkpoint_io=AtomicCheckpointIO(background=cfg.get("background", False))),
        callbacks=[preempt, ckpt], max_steps=cfg["steps"], max_epochs=-1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out, enable_checkpointing=True)
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True), ckpt_path="last")
    if trainer.global_rank == 0:  # a fit ended by SIGTERM does not come back here: Lightning ends the process
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "final.pt")
    print(f"rank {trainer.global_rank}: attempt {ATTEMPT} ended at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
