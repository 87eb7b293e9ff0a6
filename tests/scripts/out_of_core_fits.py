"""Fits of the out-of-core tests (tests/test_out_of_core.py), in-process and as a script.

``Partial``: a stack of units with parameters that get no gradient in some micro-batches; ``accumulated_fit``
trains it with gradient accumulation and returns its weights.

``shared_fit(FOLDER, ROLE, SYNC)``: one fit of ``Partial("linear", (0, 1), unused=False)`` with its store in
``FOLDER``, a folder another process's fit uses at the same time: ROLE ``first`` waits, at its first batch, until
``second`` has set up its store there, trains and tears down, then lets ``second`` (waiting at its first batch) train.
SYNC is a folder for the two processes' marks.

``python out_of_core_fits.py JOBS.json OUT_DIR``: the test's multi-process jobs in one launch, one after another, each
in processes forked from this one after its imports (tests/scripts/forked_worlds.py). JOBS holds {"jobs": [...]}:
``{"tag": T, "devices": N, "config": CONFIG}``, a world of N ranks running tests/scripts/composition_fit.py's
``CONFIG`` (in OUT_DIR), or ``{"tag": T, "shared": {"folder": F, "sync": S, "out": {ROLE: PATH}}}``, the two roles of
``shared_fit`` at once, each in a process of its own saving its weights, losses and error (``None``) to PATH. Each
job's processes write their output to OUT_DIR/T.log; when they have ended, this process appends
``{"tag": T, "exit": [exit status per process]}`` (-9: SIGKILL) to OUT_DIR/exits.jsonl and prints the log.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from lightning_horizon import HorizonStrategy  # noqa: E402
from lightning_horizon.store import StoreConfig  # noqa: E402
from recipes.gpt import GPT, GPTConfig  # noqa: E402


class Partial(L.LightningModule):
    """A stack of units, each with a parameter that never gets a gradient (``unused``, unless left out) and one that
    gets it only in the micro-batches ``used_in`` names (``sometimes``, 0: the first of a step, 1: the second), trained
    with gradient accumulation over 2 micro-batches: a GPT (``kind="gpt"``, tied embeddings, dropout) or a stack of
    Linear layers."""

    def __init__(self, kind: str, used_in: tuple[int, ...], unused: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.used_in = kind, used_in
        if kind == "gpt":
            self.net = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=3, n_head=2, n_embd=8, dropout=0.1))
            blocks = self.net.blocks
        else:
            blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
            self.net = nn.Sequential(*blocks, nn.Linear(8, 2))
        for block in blocks:
            if unused:
                block.unused = nn.Parameter(torch.ones(8))
            block.sometimes = nn.Parameter(torch.ones(8))
            block.register_forward_hook(lambda m, a, out: out * m.sometimes if self._use else out)
        self._use = False
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self._use = batch_idx % 2 in self.used_in
        if self.kind == "gpt":
            logits = self.net(batch[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        else:
            loss = self.net(batch).square().mean()
        self.losses.append(float(loss.detach()))
        return loss

    def train_dataloader(self) -> Any:
        torch.manual_seed(1)
        data = torch.randint(0, 16, (24, 9)) if self.kind == "gpt" else torch.randn(24, 8)
        return torch.utils.data.DataLoader(data, batch_size=4)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


class StepsInBackward(L.Callback):
    """Whether each optimizer step started inside backward (a step pre-hook added after setup, which the store's
    choice of when to step does not see)."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        during_backward = torch._C._current_graph_task_id
        trainer.optimizers[0].register_step_pre_hook(lambda *a: self.seen.append(during_backward() != -1))


def accumulated_fit(tmp: Path, model: L.LightningModule, store: Any, callbacks=()) -> dict[str, Tensor]:
    L.seed_everything(3, verbose=False)
    # one intra-op thread: two on a loaded 2-core machine spin far more than they compute
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HorizonStrategy(state_store=store, threads_per_rank=1),
                        max_steps=3, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp),
                        callbacks=list(callbacks))
    trainer.fit(model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _wait(mark: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not mark.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{mark} did not appear within {timeout:.0f}s")
        time.sleep(0.05)


class Turns(L.Callback):
    """The two roles' order: both stores set up in the shared folder, then ``first`` trains and tears down while
    ``second`` waits at its first batch."""

    def __init__(self, role: str, sync: Path) -> None:
        self.role, self.sync = role, sync

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.role == "second":
            (self.sync / "second-ready").touch()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        if batch_idx == 0:
            _wait(self.sync / ("second-ready" if self.role == "first" else "first-done"))


def shared_fit(folder: str | Path, role: str, sync: str | Path) -> dict[str, Any]:
    marks = Path(sync)
    model = Partial("linear", (0, 1), unused=False)
    result: dict[str, Any] = {"error": None}
    try:
        result["weights"] = accumulated_fit(marks / role, model, StoreConfig(path=str(folder), probe_bytes=0),
                                            [Turns(role, marks)])
        result["losses"] = model.losses
    except Exception as err:  # recorded for the test, which asserts on it
        result["error"] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"
    finally:
        if role == "first":
            (marks / "first-done").touch()
    return result


def shared_role(folder: str, role: str, sync: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"  # a forked process: OpenMP has not started yet
    torch.set_num_threads(1)
    torch.save(shared_fit(folder, role, sync), out)


def main(jobs: str, out_dir: str) -> None:
    from tests.scripts import composition_fit, forked_worlds  # imported before any fork: paid once

    out = Path(out_dir)
    for job in json.loads(Path(jobs).read_text())["jobs"]:
        log = out / f"{job['tag']}.log"
        if "shared" in job:
            shared = job["shared"]
            exits = forked_worlds.run_forked(
                [functools.partial(shared_role, shared["folder"], role, shared["sync"], path)
                 for role, path in shared["out"].items()], log)
        else:
            exits = forked_worlds.world(job["devices"], functools.partial(composition_fit.main, job["config"],
                                                                          out_dir), log)
        forked_worlds.record(out, job["tag"], exits, log)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
