"""The fits of the differential tester: python differential_fit.py CONFIG.json OUT_DIR

CONFIG holds {"runs": [spec, ...]} (tests/differential/plan.py's specs), all with the same number of processes;
every rank runs them in order (Lightning's launcher re-executes this script for the other local ranks; later fits
reuse the processes and the process group). A spec is

    {"name": ..., "engine": "horizon"|"ddp", "ex": EXAMPLE, "steps": N, "resume_from": PATH|null,
     "lifecycle": bool, "expect_error": [phrases]|null, "perturb": bool}

``engine="ddp"`` trains the example with Lightning's own DDPStrategy (GradNormBackoff becomes torch's
``clip_grad_norm_`` at the same hook; local SGD, ``sync_every=k > 1``, becomes DDP inside each node, on the node's
process group, and a callback that averages the parameters across the world after every k-th batch that stepped:
the definition in docs/collectives.md, written plainly); ``lifecycle`` runs the example's checkpoints (ModelCheckpoint
after the example's ``ckpt_at`` steps: the first epoch's end or the middle of an epoch, ``trainer.save_checkpoint``
after fit) and its evaluation from a checkpoint; ``perturb`` is the planted defect of the tester's own test (the
learning rate x (1 + 1e-6)). A fit resumed into another world size (``data_world``: the world whose global batch and
data it keeps) takes the per-rank batch that keeps the global batch.

Each fit writes, per rank, OUT_DIR/NAME.rank{R}.json (status, error, when it was raised, timings) and
OUT_DIR/NAME.rank{R}.pt (true weights, buffers, every optimizer's state_dict and which parameters this rank owns,
losses, validation losses, evaluation outputs); checkpoints go to OUT_DIR/NAME/. An unexpected error on a rank of
a multi-process launch ends the launch (its peers may be mid-collective): the runner relaunches the fits after it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lightning_horizon import GradNormBackoff, HorizonPrecision, HorizonStrategy  # noqa: E402
from lightning_horizon.embedding import tables_of  # noqa: E402
from lightning_horizon.store import StoreConfig  # noqa: E402
from tests.differential.models import (BATCH, COMPILED_CALLS, NodeAverage, RefClip, dataset,  # noqa: E402
                                       subject_class)
from tests.differential.space import (COST_MODELS, EPOCH_STEPS, _sharded, ckpt_step, n_optimizers,  # noqa: E402
                                      needs_unused)
from tests.scripts.composition_fit import Squeeze, sharding_of, true_weights  # noqa: E402


class MissingCheckpoint(Exception):
    """The fit that writes the checkpoint failed: nothing to resume (every rank sees it alike, before any
    collective, so the launch goes on)."""


class Recorder(L.Callback):
    """When the fit got past setup, and which parameters each optimizer's state belongs to on this rank."""

    def __init__(self, seen: dict) -> None:
        self.seen = seen  # the worker's record of where the fit is
        self.owned: list[list[bool]] = []

    def on_fit_start(self, trainer, pl_module):
        self.seen["phase"] = "training"

    def on_train_end(self, trainer, pl_module):
        state = getattr(trainer.strategy, "training_state", None)
        self.owned = [[bool(state.owns(p)) if state is not None else True for g in opt.param_groups
                       for p in g["params"]] for opt in trainer.optimizers]


def precision_args(name: str) -> dict:
    if name in ("64-true", "32-true"):
        return {"precision": name}
    if name == "bf16-mixed":
        return {"plugins": [HorizonPrecision("bf16-mixed", compute="fp32")]}
    master = name.split("+")[1]
    return {"plugins": [HorizonPrecision("bf16-true", master=master, compute="fp32")]}


_NODE_GROUPS: dict = {}


def node_group(rpn: int) -> Any:
    """This rank's node as a process group (every rank creates every node's group, in the same order)."""
    world = dist.get_world_size()
    k = (id(dist.group.WORLD), rpn)
    if k not in _NODE_GROUPS:
        groups = [dist.new_group(list(range(n, n + rpn))) for n in range(0, world, rpn)]
        _NODE_GROUPS[k] = groups[dist.get_rank() // rpn]
    return _NODE_GROUPS[k]


class NodeDDPStrategy(DDPStrategy):
    """Lightning's "ddp" with DDP's gradient allreduce on the node's process group only (local SGD's reference)."""

    def __init__(self, ranks_per_node: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ranks_per_node = ranks_per_node

    def setup(self, trainer: L.Trainer) -> None:
        self._ddp_kwargs["process_group"] = node_group(self.ranks_per_node)  # the default group exists by now
        super().setup(trainer)


def strategy_of(spec: dict) -> Any:
    ex = spec["ex"]
    unused = needs_unused(ex) and not _sharded(ex)
    if spec["engine"] == "ddp":
        # the same buckets as horizon's: gloo's sum order over an element follows its bucket's size, and a
        # gradient that is rounding noise (a bias feeding BatchNorm) carries the order into the weights
        kwargs = dict(find_unused_parameters=needs_unused(ex), process_group_backend="gloo",
                      timeout=timedelta(seconds=60), bucket_cap_mb=ex["bucket_mb"])
        return NodeDDPStrategy(ex["rpn"], **kwargs) if ex["sync_every"] > 1 else DDPStrategy(**kwargs)
    kwargs: dict = {"ranks_per_node": ex["rpn"], "threads_per_rank": 1, "timeout": 60,
                    "bucket_size_mb": ex["bucket_mb"], "state": ex["state"], "collectives": ex["collectives"],
                    "compression": ex["compression"], "sync_every": ex["sync_every"],
                    "sharding": sharding_of({"sharding": ex["sharding"]})}
    if ex["state"] == "node_sharded":
        kwargs["shard_group_nodes"] = ex["shard_nodes"]
    if ex["sync_every"] > 1:
        kwargs.update(outer=ex["outer"], sync_overlap=ex["overlap"])
    if ex["torus_shape"] is not None:
        kwargs["torus_shape"] = tuple(ex["torus_shape"])
    if ex["cost_model"] is not None:
        kwargs["cost_model"] = COST_MODELS[ex["cost_model"]]
    if ex["store"] is not None:
        kwargs["state_store"] = StoreConfig(step=ex["store"]["step"], prefetch=ex["store"]["prefetch"], probe_bytes=0)
    if unused and ex["world"] > 1:
        kwargs["find_unused_parameters"] = True
    return HorizonStrategy(**kwargs)


def whole_tables(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with each sharded table whole (every rank's rows, gathered to every rank): as "ddp" holds it.
    Ranks 0 .. n-1 hold one copy's rows in order (the world's, or under span="node" node 0's n ranks)."""
    for name, table in tables_of(model).items():
        if table.rows_on_disk is not None:  # its Parameter is the cache: the rows are in its state dict
            whole = table.state_dict()["weight"].clone()  # collective: whole on the first rank of the copy
            if table.placed:
                shards = [None] * dist.get_world_size()
                dist.all_gather_object(shards, whole)
                whole = shards[0]
            weights[f"{name}.weight"] = whole
        elif table.placed:
            shards: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(shards, table.weight.detach())
            weights[f"{name}.weight"] = torch.cat(shards[:table.world])
    return weights


def optimizer_states(trainer: L.Trainer) -> list[dict]:
    return [opt.state_dict() for opt in trainer.optimizers]


def fit(spec: dict, out: Path, seen: dict) -> dict:
    ex, name = spec["ex"], spec["name"]
    if spec["resume_from"] and not (out / spec["resume_from"]).exists():
        raise MissingCheckpoint(f"{spec['resume_from']} was not written (the fit that writes it failed)")
    seen["phase"] = "construction"
    if ex["model"].get("compile"):  # every fit compiles afresh (one process runs many: no recompile limit reached)
        torch._dynamo.reset()
    COMPILED_CALLS[0] = 0
    L.seed_everything(ex["seed"], verbose=False)
    model = subject_class(ex)(ex, perturb=spec["perturb"])
    if ex["precision"] == "64-true":
        model.double()  # built in float64, as Trainer.init_module would: a resume loads float64 into float64
    n_opt = n_optimizers(ex)
    recorder = Recorder(seen)
    callbacks: list[L.Callback] = [recorder]
    lifecycle = spec["lifecycle"]
    if lifecycle and ex["ckpt_during"]:
        callbacks.append(ModelCheckpoint(dirpath=out / name / "ckpt", filename="{step}", save_top_k=-1,
                                         every_n_train_steps=ckpt_step(ex) * n_opt, save_last=False))
    backoff = ex["backoff"]
    if backoff is not None and spec["engine"] == "horizon":
        callbacks.append(GradNormBackoff(max_norm=backoff["max_norm"], spike_threshold=None))
    elif backoff is not None and backoff["max_norm"] is not None:
        callbacks.append(RefClip(backoff["max_norm"]))
    if spec["engine"] == "ddp" and ex["sync_every"] > 1:
        callbacks.append(NodeAverage(ex["sync_every"], ex["outer"], ex["overlap"]))
    if spec["engine"] == "horizon" and ex["sharding"] == "forced":
        callbacks.append(Squeeze())
    clip = ex["clip"] if ex["clip"] and ex["clip"]["where"] == "trainer" else None
    strategy = strategy_of(spec)
    trainer = L.Trainer(
        accelerator="cpu", devices=ex["world"], strategy=strategy, callbacks=callbacks,
        max_steps=spec["steps"] * n_opt, max_epochs=-1, accumulate_grad_batches=ex["accumulate"], logger=False,
        enable_checkpointing=lifecycle and ex["ckpt_during"], enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(out / name / "root"),
        gradient_clip_val=clip["value"] if clip else None,
        gradient_clip_algorithm=clip["algorithm"] if clip else None,
        check_val_every_n_epoch=1,
        **precision_args(ex["precision"]),
    )
    seen["phase"] = "setup"
    kind = ex["model"]["kind"]
    # every rank: EPOCH_STEPS steps per epoch; a fit resumed into another world size keeps the global batch and data
    data_world = ex.get("data_world", ex["world"])
    samples = data_world * EPOCH_STEPS * ex["accumulate"] * BATCH
    train = DataLoader(dataset(kind, samples, 1234), batch_size=BATCH * data_world // ex["world"], shuffle=True)
    val = DataLoader(dataset(kind, ex["world"] * 2 * BATCH, 99), batch_size=BATCH)
    resume = str(out / spec["resume_from"]) if spec["resume_from"] else None
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer.fit(model, train, val if ex["validate"] else None, ckpt_path=resume)
    seen["phase"] = "after fit"
    result: dict[str, Any] = {
        "rank": trainer.global_rank, "global_step": trainer.global_step, "epoch": trainer.current_epoch,
        "weights": whole_tables(model, true_weights(trainer, model)),
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "optim": optimizer_states(trainer), "owned": recorder.owned, "losses": list(model.losses),
        "val_losses": list(model.val_losses), "eval": None, "initial": initial, "compiled": COMPILED_CALLS[0],
    }
    if lifecycle and ex["save_after"]:
        seen["phase"] = "save after fit"
        trainer.save_checkpoint(out / name / "after.ckpt")
    if lifecycle and ex["eval"] is not None:
        seen["phase"] = f"{ex['eval']['kind']} from the checkpoint"
        path = out / name / ("after.ckpt" if ex["eval"]["from"] == "after" else
                             f"ckpt/step={ckpt_step(ex) * n_opt}.ckpt")
        model.val_losses, model.eval_out = [], []
        kind_ = ex["eval"]["kind"]
        if kind_ == "validate":
            trainer.validate(model, dataloaders=val, ckpt_path=str(path), verbose=False)
            result["eval"] = list(model.val_losses)
        elif kind_ == "test":
            trainer.test(model, dataloaders=val, ckpt_path=str(path), verbose=False)
            result["eval"] = list(model.eval_out)
        else:
            result["eval"] = [t.clone() for t in trainer.predict(model, dataloaders=val, ckpt_path=str(path))]
    return result


def rank_of_process() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def write(out: Path, name: str, rank: int, summary: dict, tensors: dict) -> None:
    torch.save(tensors, out / f"{name}.rank{rank}.pt")
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(summary))  # last: its presence means both are there


def main(config: str, out_dir: str) -> None:
    out = Path(out_dir)
    specs = json.loads(Path(config).read_text())["runs"]
    for spec in specs:
        t0 = time.monotonic()
        seen: dict = {"phase": "construction"}
        try:
            result = fit(spec, out, seen)
        except Exception as err:  # recorded for the test, which asserts on it
            message = f"{type(err).__name__}: {err}"
            phrases = spec.get("expect_error")
            rank = rank_of_process()
            summary = {"rank": rank, "status": "error", "error": message, "phase": seen["phase"],
                       "traceback": traceback.format_exc()[-4000:], "seconds": time.monotonic() - t0,
                       "missing_checkpoint": isinstance(err, MissingCheckpoint)}
            write(out, spec["name"], rank, summary, {})
            print(f"RUN {spec['name']} rank {rank} FAILED ({seen['phase']}) after {summary['seconds']:.1f}s:"
                  f" {message[:300]}", flush=True)
            # a refusal at construction or setup is raised by every rank before any collective: the launch goes on
            alike = isinstance(err, MissingCheckpoint) or (phrases and seen["phase"] in ("construction", "setup"))
            if spec["world"] > 1 and not alike:
                sys.stdout.flush()
                os._exit(3)  # the peers may be waiting in a collective this rank never joins
            continue
        summary = {"rank": result["rank"], "status": "ok", "seconds": time.monotonic() - t0,
                   "global_step": result["global_step"]}
        write(out, spec["name"], result["rank"], summary, result)
        if result["rank"] == 0:
            print(f"RUN {spec['name']} ok {summary['seconds']:.1f}s", flush=True)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # explicitly: gloo groups torn down at interpreter exit can abort


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
