"""Full, unsharded checkpoints from node-sharded state, and loading any checkpoint into any ownership.

Each rank holds the optimizer state (and the precision policy's masters or compensations) of the parameters it owns;
the first shard group's ranks (node 0's, or with ``shard_group_nodes=k`` the first k nodes') together hold all of
it. Saving gathers their pieces to rank 0 and merges them into exactly the dicts
a replicated run writes: the optimizer's ``state`` keyed by parameter index, the precision state's per-name masters.
A piece holds only the entries of the parameters its rank owns, whatever else that rank's optimizer or precision
holds (Adagrad's constructor makes state for every parameter; after fit, ``validate`` makes masters for all).
So a checkpoint loads into a plain module (``strict=True``), into ``state="replicated"`` and into any other layout.
Loading keeps only what this rank owns (the rest is dropped before the optimizer allocates it).

With ``state_checkpoint="per_rank"`` nothing is gathered: each rank of the first shard group writes its share next
to the checkpoint (``<checkpoint>.state/rank<i>.pt``, each file atomic), all ranks wait, and only then rank 0 writes the
checkpoint itself, with the weights and everything but the shares, naming how many files it has: a checkpoint file
never names files that are not complete. Loading reads the files (memory-mapped) and merges them back into the dicts
a full checkpoint has, so a per-rank checkpoint too loads into any layout and into ``state="replicated"``.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_horizon.checkpoint_io import atomic_file
from lightning_horizon.parts import CheckpointStep

#: the precision state's per-parameter dicts (HorizonPrecision's bf16-true policies), merged by name
PER_NAME = ("masters", "compensation")


def local_part(checkpoint: dict[str, Any], precision_key: Optional[str], optimizers: list[Any],
               names: dict[str, Tensor], owns: Callable[[Tensor], bool]) -> dict[str, Any]:
    """This rank's share of ``checkpoint``: the per-parameter optimizer state and precision masters of the parameters
    ``owns`` accepts. ``optimizers`` are the ones ``checkpoint["optimizer_states"]`` was taken from, ``names`` the
    module's parameters by name."""
    part: dict[str, Any] = {"optimizer_states": [
        owned_optimizer_state(s, [p for g in opt.param_groups for p in g["params"]], owns)["state"]
        for opt, s in zip(optimizers, checkpoint.get("optimizer_states", []))
    ]}
    precision = checkpoint.get(precision_key) if precision_key else None
    if isinstance(precision, dict):
        part["precision"] = {k: {n: v for n, v in precision[k].items() if n not in names or owns(names[n])}
                             for k in PER_NAME if isinstance(precision.get(k), dict)}
    return part


def merge(checkpoint: dict[str, Any], parts: list[dict[str, Any]], precision_key: Optional[str]) -> None:
    """Fold every rank's share (``parts``, the first shard group's ranks in rank order) into rank 0's
    ``checkpoint``, in place. An entry in several shares (a frozen parameter, every rank's) is taken from the first."""
    for i, opt_state in enumerate(checkpoint.get("optimizer_states", [])):
        merged: dict[int, Any] = {}
        for part in parts:
            for index, state in part["optimizer_states"][i].items():
                merged.setdefault(index, state)
        opt_state["state"] = dict(sorted(merged.items()))
    precision = checkpoint.get(precision_key) if precision_key else None
    if isinstance(precision, dict):
        for key in PER_NAME:
            if isinstance(precision.get(key), dict):
                merged_names: dict[str, Tensor] = {}
                for part in parts:
                    for name, tensor in part.get("precision", {}).get(key, {}).items():
                        merged_names.setdefault(name, tensor)
                precision[key] = merged_names


def state_dir(checkpoint_path: Any) -> str:
    """Where the per-rank files of ``checkpoint_path`` live (next to it; through a symlinked ``last.ckpt`` too)."""
    return os.path.realpath(os.fspath(checkpoint_path)) + ".state"


def write_part(part: dict[str, Any], checkpoint_path: Any, rank: int) -> None:
    with atomic_file(os.path.join(state_dir(checkpoint_path), f"rank{rank}.pt")) as f:
        torch.save(part, f)


def strip(checkpoint: dict[str, Any], precision_key: Optional[str]) -> None:
    """Remove the shares (they are in the per-rank files) from the checkpoint rank 0 writes."""
    for opt_state in checkpoint.get("optimizer_states", []):
        opt_state["state"] = {}
    precision = checkpoint.get(precision_key) if precision_key else None
    if isinstance(precision, dict):
        for key in PER_NAME:
            if isinstance(precision.get(key), dict):
                precision[key] = {}


def read_parts(checkpoint_path: Any, files: int) -> list[dict[str, Any]]:
    """The per-rank shares written next to ``checkpoint_path``; a missing file fails naming it."""
    directory = state_dir(checkpoint_path)
    parts = []
    for i in range(files):
        path = os.path.join(directory, f"rank{i}.pt")
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{checkpoint_path} was saved with HorizonStrategy(state_checkpoint='per_rank'): its optimizer state"
                f" is in {directory}/rank0.pt .. rank{files - 1}.pt, and {path} is missing (copy the folder along"
                " with the checkpoint)"
            )
        parts.append(torch.load(path, map_location="cpu", mmap=True, weights_only=False))
    return parts


def remove_parts(checkpoint_path: Any) -> None:
    shutil.rmtree(state_dir(checkpoint_path), ignore_errors=True)


def owned_optimizer_state(opt_state: dict[str, Any], params: list[Tensor], owns: Callable[[Tensor], bool]) -> dict:
    """``opt_state`` (a full optimizer state dict) with only the entries of the parameters this rank owns;
    ``params`` are the optimizer's parameters in param-group order (the state dict's indices)."""
    keep = {i for i, p in enumerate(params) if owns(p)}
    return {**opt_state, "state": {i: s for i, s in opt_state.get("state", {}).items() if i in keep}}


class NodeShardedCheckpoint(CheckpointStep):
    """Node-sharded state in the strategy's checkpoints (the module docstring): each rank's share of the optimizer
    state and masters gathered into rank 0's checkpoint, or written to per-rank files; also when
    ``trainer.save_checkpoint`` runs after fit (the optimizers still hold the shares then). Loading merges per-rank
    files back, and each rank's optimizers take the state of what it owns."""

    def save(self, strategy: Any, checkpoint: dict[str, Any], filepath: Any, rank_entry: dict[str, Any]) -> dict:
        shares = strategy.node_shares
        if shares is None:
            return {}
        if shares is not strategy.node_state:
            rank_entry["node_state"] = shares.state_dict()  # after fit: its per-rank state, as a save at the fit's end
        key = type(strategy.precision_plugin).__qualname__
        mine = None
        if shares.in_first_shard_group:  # ranks 0 .. n - 1 hold everything; the others send nothing
            names = dict(strategy.lightning_module.named_parameters())
            mine = local_part(checkpoint, key, strategy.optimizers, names, shares.owns)
        if strategy.options.node_state.state_checkpoint == "full" or "optimizer_states" not in checkpoint:
            parts = strategy.checkpoints.gather_objects(mine)
            if parts is not None:
                merge(checkpoint, [p for p in parts if p is not None], key)
            return {}
        if mine is not None:
            write_part(mine, filepath, strategy.topology.rank)
        strategy.barrier("per-rank state written")  # before rank 0 writes the checkpoint that names the files
        strip(checkpoint, key)
        return {"state_files": shares.owners.count}

    def load(self, strategy: Any, checkpoint: dict[str, Any], saved: dict[str, Any], path: Any,
             same_layout: bool) -> dict[str, Any]:
        if saved.get("state_files") and "optimizer_states" in checkpoint:
            # saved per rank: back into the dicts a full checkpoint has, whatever this run's layout
            merge(checkpoint, read_parts(path, saved["state_files"]), type(strategy.precision_plugin).__qualname__)
        return checkpoint

    def optimizer_states(self, strategy: Any, checkpoint: dict[str, Any]) -> dict[str, Any]:
        node = strategy.node_state  # a full checkpoint, any layout: each rank takes the state of what it owns
        if node is None:
            return checkpoint
        return {**checkpoint, "optimizer_states": [
            owned_optimizer_state(s, [p for g in opt.param_groups for p in g["params"]], node.owns)
            for opt, s in zip(strategy.optimizers, checkpoint["optimizer_states"])]}

    def removed(self, strategy: Any, filepath: Any) -> None:
        if strategy.is_global_zero:
            remove_parts(filepath)  # a per-rank checkpoint's folder goes with it


__all__ = ["NodeShardedCheckpoint", "PER_NAME", "local_part", "merge", "owned_optimizer_state", "read_parts",
           "remove_parts", "state_dir",
           "strip", "write_part"]
