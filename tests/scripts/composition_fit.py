"""The runs of the composition matrix: python composition_fit.py CONFIG.json OUT_DIR

CONFIG holds {"runs": [{...}, ...]}, all with the same number of processes; every rank runs them in order, later
fits reusing the processes and the process group. tests/test_composition.py calls ``main(CONFIG, OUT_DIR)`` in each
rank of a world forked from one launch (tests/launch.run_worlds); run as a script, Lightning's launcher re-executes
it for the other local ranks. A run is

    {"name": ..., "model": KIND, "optimization": "automatic"|"manual"|"manual-twice"|"accumulate", "world": 1|2|4,
     "ranks_per_node": 1|2, "precision": "32-true"|"64-true"|{HorizonPrecision kwargs},
     "strategy": {"collectives": ..., "compression": ..., "sync_every": ...},
     "sharding": null|"auto"|"forced", "backoff": bool, "steps": N, "epoch_steps": E,
     "save_at": K|null, "resume_from": PATH|null, "expect_error": [substrings]|null, "round_init": bool,
     "scheduler": bool, "gradient_clip_val": float|null, "kill_at": K|null, "backward_hooks": bool}

``strategy["state_store"]``, a dict, is a ``StoreConfig``'s arguments (out-of-core training); ``kill_at`` SIGKILLs
the process at the start of training step K (a crash: the test checks what it left behind, then resumes).
``backward_hooks=false`` leaves out the checks that run between backward and the step (``on_after_backward``,
``on_before_optimizer_step``): with them the store steps after backward (its ``step="auto"``).

``steps`` and ``save_at`` count training steps (a manual step with two optimizers is two of Lightning's
global steps); an epoch is ``epoch_steps`` training steps, so a checkpoint at an epoch boundary resumes exactly.
``sharding="forced"`` plans with a roomy byte budget, then cuts the budget after the first step below what any
plan reaches (as a cgroup squeeze would): from the second step on, the plan with the smallest peak is installed,
i.e. as much activation recompute as the model allows. ``round_init`` rounds the initial weights to bf16 (the
start a bf16-true fit has), for an fp32 reference of a bf16-true case. ``scheduler`` (automatic optimization) adds
a LambdaLR to the optimizer. ``backoff`` adds GradNormBackoff and
injects a NaN loss on the last rank in training step 1 and a spike on rank 0 in training step 2.

Each run writes OUT_DIR/NAME.rank{R}.pt as soon as it ends: the true weights after every optimizer step (fp32
masters / bf16 + compensation under bf16-true), the final buffers, what reached user code that should not have
(FakeTensor, meta), the backoff counters, the recompute count, the optimizer state held and the bytes the strategy
counted in the last step, or the error. An unexpected error in a
multi-process world ends the process (its peers may be left mid-collective): the test relaunches the runs after it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lightning_horizon import GradNormBackoff, HorizonPrecision, HorizonStrategy  # noqa: E402
from lightning_horizon.sharding import ShardingConfig  # noqa: E402
from lightning_horizon.store import StoreConfig  # noqa: E402
from tests.scripts.composition_models import BATCH, bad_tensors, build, dataset, module_bad_tensors  # noqa: E402

ROOMY = 1.0  # the rank's whole share of the node: no tiny model reaches it, the first plan recomputes nothing


def true_weights(trainer: L.Trainer, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's true value (tied ones once, under their first name), as a detached copy.

    Through the precision's TrainingState (``lightning_horizon/state.py``) where it has one; else from the
    precision's checkpoint state (``masters`` / ``compensation``); else the parameter itself.
    """
    plugin = trainer.precision_plugin
    state = getattr(plugin, "training_state", None)
    out = {}
    if state is not None and hasattr(state, "read"):
        for name, p in module.named_parameters():
            out[name] = state.read(p) if p.is_floating_point() and p.dtype == torch.bfloat16 else p.detach().clone()
        return out
    sd = plugin.state_dict() if isinstance(plugin, HorizonPrecision) else {}
    masters, comps = sd.get("masters", {}), sd.get("compensation", {})
    for name, p in module.named_parameters():
        if name in masters:
            out[name] = masters[name].detach().float().clone()
        elif name in comps:
            out[name] = p.detach().float() + comps[name].float()
        else:
            out[name] = p.detach().clone()
    return out


class Recorder(L.Callback):
    """The true weights after every optimizer step, the backoff's counters, and every fake/meta tensor that
    reaches a callback hook."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, torch.Tensor]] = {}
        self.violations: list[str] = []
        self.initial: dict[str, torch.Tensor] = {}
        self.recompute: list[int] = []  # calls the plan recomputes, per micro-batch
        self.recomputed: list[str] = []  # which, in the last plan
        self.backoff: Optional[GradNormBackoff] = None
        self.comm: dict[str, float] = {}  # what the strategy counted as sent in the last step
        self.norms: dict[int, list[float]] = {}  # global step -> the backoff's pre-clip norm per optimizer
        self.store_kinds: list[str] = []  # out-of-core: the kinds of tensors in the store's files
        self.store_holds: list[bool] = []  # [every trainable parameter, every optimizer state tensor] in the store
        self.in_backward: Optional[bool] = None  # out-of-core: the optimizer step ran in backward

    def _check(self, what, where: str) -> None:
        self.violations += bad_tensors(what, where)

    def on_train_start(self, trainer, pl_module):
        self.initial = true_weights(trainer, pl_module)
        self.violations += module_bad_tensors(pl_module, "module at on_train_start")
        store = getattr(trainer.strategy, "store", None)
        self.in_backward = store.in_backward if store is not None else None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._check(batch, f"on_train_batch_start(batch) step {trainer.global_step}")

    def on_before_backward(self, trainer, pl_module, loss):
        self._check(loss, f"on_before_backward(loss) step {trainer.global_step}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._check(outputs, f"on_train_batch_end(outputs) step {trainer.global_step}")
        self.violations += module_bad_tensors(pl_module, f"module at on_train_batch_end step {trainer.global_step}")
        if trainer.global_step not in self.rows:
            self.rows[trainer.global_step] = true_weights(trainer, pl_module)
        self.comm = getattr(trainer.strategy, "comm_metrics", dict)()
        if self.backoff is not None and trainer.global_step not in self.norms:
            self.norms[trainer.global_step] = [s.last_grad_norm for s in self.backoff.states]
        store = getattr(trainer.strategy, "store", None)
        if store is not None and store.store is not None:  # out-of-core: what lives in the store's files
            held = {v.data_ptr() for v in store.store._views.values()}
            self.store_kinds = sorted({kind.split(".")[0] for _, kind in store.store._views})
            self.store_holds = [all(p.data_ptr() in held for p in pl_module.parameters() if p.requires_grad),
                                all(v.data_ptr() in held for o in trainer.optimizers for st in o.state.values()
                                    for v in st.values() if torch.is_tensor(v) and v.dim() > 0)]
        sharder = getattr(trainer.strategy, "sharder", None)
        if sharder is not None and sharder.plan is not None:
            self.recompute.append(len(sharder.plan.recompute))
            self.recomputed = [f"{name}#{occurrence}" for name, occurrence in sharder.plan.recompute]

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._check(checkpoint, "on_save_checkpoint(checkpoint)")


class BackwardChecks(L.Callback):
    """The Recorder's checks between backward and the step."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def on_after_backward(self, trainer, pl_module):
        self.recorder.violations += module_bad_tensors(pl_module, "module at on_after_backward step"
                                                       f" {trainer.global_step}")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.recorder._check(params, f"on_before_optimizer_step(optimizer params) step {trainer.global_step}")


class Kill(L.Callback):
    """SIGKILL this process at the start of training step ``step``: a crash, nothing cleaned up."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            print(f"KILLED at step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class Squeeze(L.Callback):
    """After the first training step, cut the sharding budget below any plan: the next step boundary installs the
    plan with the smallest peak (best effort: the most recompute the model allows)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sharder = getattr(trainer.strategy, "sharder", None)
        if sharder is not None and sharder.plan is not None and trainer.global_step >= 1 and not sharder.plan.recompute:
            sharder.set_budget(max(1, sharder.plan.floor // 2), "composition test squeeze")  # re-plans at the boundary


def sharding_of(run: dict):
    if run["sharding"] is None:
        return None
    if run["sharding"] == "auto":
        return "auto"
    return ShardingConfig(budget=ROOMY, allocator_overhead=1.0, adaptive=False)


def precision_args(run: dict) -> dict:
    p = run["precision"]
    if isinstance(p, str):
        return {"precision": p}
    return {"plugins": [HorizonPrecision(**p)]}


class MissingCheckpoint(Exception):
    """The fit that writes the checkpoint failed: nothing to resume (every rank sees it alike, before any
    collective, so the launch goes on)."""


def fit(run: dict, out: Path, seen: dict) -> dict:
    if run.get("resume_from") and not Path(run["resume_from"]).exists():
        raise MissingCheckpoint(f"{run['resume_from']} was not written (the fit that writes it failed)")
    L.seed_everything(run.get("seed", 7), verbose=False)
    n_opt = 2 if run["optimization"] == "manual" else 1
    accumulate = 2 if run["optimization"] == "accumulate" else 1
    inject = {"nan": [1, run["world"] - 1], "spike": [2, 0]} if run["backoff"] else None
    model = build(run["model"], run["optimization"], inject)
    model.scheduler = bool(run.get("scheduler"))
    if run.get("round_init"):  # a reference for bf16-true: the same bf16-rounded start, trained in fp32
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
    recorder = Recorder()
    seen.update(model=model, recorder=recorder)
    callbacks: list[L.Callback] = [recorder] + ([BackwardChecks(recorder)] if run.get("backward_hooks", True) else [])
    backoff = None
    if run["backoff"]:
        backoff = GradNormBackoff(max_norm=1.0, spike_threshold=1e3, factor=0.5, recover_after=100)
        callbacks.append(backoff)
        recorder.backoff = backoff
    if run["sharding"] == "forced":
        callbacks.append(Squeeze())
    if run.get("kill_at"):
        callbacks.append(Kill(run["kill_at"]))
    strategy_args = dict(run["strategy"])
    if isinstance(strategy_args.get("state_store"), dict):
        strategy_args["state_store"] = StoreConfig(**strategy_args["state_store"])
    if run.get("save_at"):
        callbacks.append(ModelCheckpoint(dirpath=out / f"{run['name']}.ckpt", filename="{step}",
                                         every_n_train_steps=run["save_at"] * n_opt, save_top_k=-1,
                                         save_last=False))
    strategy = HorizonStrategy(ranks_per_node=run["ranks_per_node"], threads_per_rank=1, timeout=45,
                               sharding=sharding_of(run), bucket_size_mb=0.004, **strategy_args)
    trainer = L.Trainer(
        accelerator="cpu", devices=run["world"], strategy=strategy, callbacks=callbacks,
        max_steps=run["steps"] * n_opt, max_epochs=-1, accumulate_grad_batches=accumulate, logger=False,
        enable_checkpointing=bool(run.get("save_at")), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(out / "root"), gradient_clip_val=run.get("gradient_clip_val"),
        **precision_args(run),
    )
    # every epoch is epoch_steps training steps on every rank: a checkpoint at an epoch boundary resumes exactly
    samples = run["world"] * run["epoch_steps"] * accumulate * BATCH
    loader = DataLoader(dataset(run["model"], samples), batch_size=BATCH, shuffle=True)
    trainer.fit(model, loader, ckpt_path=run.get("resume_from"))
    module = trainer.lightning_module
    return {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "rows": recorder.rows,
        "initial": recorder.initial,
        "final": true_weights(trainer, module),
        # node-sharded state: the parameters whose master / compensation this rank holds (the others' true value is
        # on their owner)
        "true_here": [n for n, p in module.named_parameters()
                      if getattr(trainer.precision_plugin, "training_state", None) is not None
                      and trainer.precision_plugin.training_state.where(p) != "module"],
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        # the optimizer state this rank holds (elements of its tensors, step counters aside)
        "state_numel": sum(v.numel() for o in trainer.optimizers for st in o.state.values() for v in st.values()
                           if torch.is_tensor(v) and v.dim() > 0),
        "comm": recorder.comm,
        "buffers": {n: b.detach().clone() for n, b in module.named_buffers()},
        "violations": recorder.violations + model.violations,
        "losses": model.losses,
        "recompute": recorder.recompute,
        "recomputed": recorder.recomputed,
        "norms": recorder.norms,
        "skipped": [s.skipped_steps for s in backoff.states] if backoff else None,
        "spikes": [s.spikes for s in backoff.states] if backoff else None,
        "lr_scale": [s.scale for s in backoff.states] if backoff else None,
        "error": None,
        # node-sharded state maps the node's weights from /dev/shm during fit only: nothing may stay mapped
        "shm_after_fit": "lightning-horizon-" in Path("/proc/self/maps").read_text(),
        "store_kinds": recorder.store_kinds,
        "store_holds": recorder.store_holds,
        "in_backward": recorder.in_backward,
    }


def rank_of_process() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def main(config: str, out_dir: str) -> None:
    out = Path(out_dir)
    runs = json.loads(Path(config).read_text())["runs"]
    for run in runs:
        t0 = time.monotonic()
        seen: dict = {}
        try:
            result = fit(run, out, seen)
        except Exception as err:  # recorded for the test, which asserts on it
            message = f"{type(err).__name__}: {err}"
            expected = run.get("expect_error")
            violations = [*getattr(seen.get("recorder"), "violations", []),
                          *getattr(seen.get("model"), "violations", [])]
            result = {"rank": rank_of_process(), "error": message, "traceback": traceback.format_exc()[-6000:],
                      "expected": bool(expected) and all(s in message for s in expected), "violations": violations}
            result["seconds"] = time.monotonic() - t0
            torch.save(result, out / f"{run['name']}.rank{result['rank']}.pt")
            print(f"RUN {run['name']} rank {result['rank']} FAILED after {result['seconds']:.1f}s: {message}",
                  flush=True)
            if run["world"] > 1 and not result["expected"] and not isinstance(err, MissingCheckpoint):
                # the peers may be waiting in a collective this rank never joins: end the launch, the test
                # relaunches the runs after this one
                sys.stdout.flush()
                os._exit(3)
            continue
        result["seconds"] = time.monotonic() - t0
        torch.save(result, out / f"{run['name']}.rank{result['rank']}.pt")
        if result["rank"] == 0:
            print(f"RUN {run['name']} ok {result['seconds']:.1f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
