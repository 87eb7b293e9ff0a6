"""What HorizonStrategy adds to Lightning's checkpoints, as a mixin of the strategy (strategy.py).

Every rank calls ``save_checkpoint``; the parts' state differs per rank (RNG, error feedback, plans), so it is gathered
to rank 0, which writes it under one key (``"HorizonStrategy"``: the world size and one dict per rank). Under local
SGD each node's weights travel along (collectives/local_sgd.py); under node-sharded state each rank's share of the
optimizer state and masters is gathered into the dicts a replicated run writes, or written to per-rank files
(node_state/checkpoint.py), also when ``trainer.save_checkpoint`` runs after fit (the optimizers still hold the
shares then). Loading hands each rank its own part states and, node-sharded, its own share.

The mixin reads the strategy's ``parts``, ``node_state``, ``node_shares``, ``topology``, ``nodes_diverge`` and
``_state_checkpoint``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_horizon import wire
from lightning_horizon.collectives.local_sgd import NODE_KEY, node_state, this_nodes_checkpoint
from lightning_horizon.node_state import checkpoint as node_checkpoint

log = logging.getLogger("lightning_horizon.strategy")

CHECKPOINT_KEY = "HorizonStrategy"


class CheckpointParts:
    """``save_checkpoint`` / ``load_checkpoint`` and friends of HorizonStrategy (before DDPStrategy in its bases)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        # Called on every rank; the parts' state differs per rank (RNG, error feedback, plans), so gather it
        # to rank 0, which writes the file.
        self.parts.before_save(self.model)  # e.g. the bucket layout the next step reduces in (collective)
        shares = self.node_shares
        files = self._save_node_state(checkpoint, filepath, shares) if shares is not None else 0
        states = self.parts.state_dicts()
        if shares is not None and shares is not self.node_state:
            states["node_state"] = shares.state_dict()  # after fit: its per-rank state, as a save at the fit's end
        if self.nodes_diverge and self.topology.local_rank == 0 and self.topology.node_rank > 0:
            states[NODE_KEY] = node_state(checkpoint, type(self.precision_plugin).__qualname__)
        ranks = self._gather_objects(states)
        if ranks is not None:
            checkpoint[CHECKPOINT_KEY] = {"world_size": self.world_size, "ranks": ranks, "state_files": files}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _save_node_state(self, checkpoint: dict[str, Any], filepath: Any, shares: Any) -> int:
        """Each rank holds its parameters' optimizer state and masters (node 0's ranks hold everything; the other
        nodes send nothing): gathered into rank 0's checkpoint, as one replicated run writes it, or written by
        each rank to its own file (``state_checkpoint="per_rank"``). Returns the number of such files."""
        assert self.topology is not None
        key = type(self.precision_plugin).__qualname__
        mine = None
        if self.topology.node_rank == 0:
            names = dict(self.lightning_module.named_parameters())
            mine = node_checkpoint.local_part(checkpoint, key, self.optimizers, names, shares.owns)
        if self._state_checkpoint == "full" or "optimizer_states" not in checkpoint:
            parts = self._gather_objects(mine)
            if parts is not None:
                node_checkpoint.merge(checkpoint, [p for p in parts if p is not None], key)
            return 0
        if mine is not None:
            node_checkpoint.write_part(mine, filepath, self.topology.local_rank)
        self.barrier("per-rank state written")  # before rank 0 writes the checkpoint that names the files
        node_checkpoint.strip(checkpoint, key)
        return self.topology.ranks_per_node

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            node_checkpoint.remove_parts(filepath)  # a per-rank checkpoint's folder goes with it

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get(CHECKPOINT_KEY)
        trainer = getattr(self.lightning_module, "_trainer", None)
        fitting = trainer is None or trainer.state.fn == TrainerFn.FITTING
        if fitting and saved is not None and saved.get("state_files") and "optimizer_states" in checkpoint:
            # saved per rank (node-sharded): back into the dicts a full checkpoint has, whatever this run's layout
            key = type(self.precision_plugin).__qualname__
            node_checkpoint.merge(checkpoint, node_checkpoint.read_parts(checkpoint_path, saved["state_files"]), key)
        if saved is None or not fitting:
            # validate/test/predict(ckpt_path=...) take the weights only, as under DDP: the per-rank state (RNG,
            # error feedback, plans) is for resuming training, and restoring the RNG would move the user's draws
            return checkpoint
        if saved["world_size"] != self.world_size:
            log.warning(
                f"HorizonStrategy: checkpoint saved with world size {saved['world_size']}, resuming with"
                f" {self.world_size}: per-rank state (RNG, collectives, sharding) starts fresh"
            )
            return checkpoint
        # parts that exist get their state now, the others when setup creates them
        self.parts.load_state_dicts({k: v for k, v in saved["ranks"][self.global_rank].items() if k != NODE_KEY})
        if self.nodes_diverge:
            # Lightning restores the weights, optimizer and precision state from this dict: give it this node's
            checkpoint, self._node_weights = this_nodes_checkpoint(
                checkpoint, saved["ranks"], self.topology.node_rank, self.topology.ranks_per_node
            )
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        node = self.node_state
        if node is None:
            return super().load_optimizer_state_dict(checkpoint)
        # a full checkpoint (any layout): each rank takes the state of the parameters it owns, nothing more
        owned = dict(checkpoint)
        owned["optimizer_states"] = [
            node_checkpoint.owned_optimizer_state(s, [p for g in opt.param_groups for p in g["params"]], node.owns)
            for opt, s in zip(self.optimizers, checkpoint["optimizer_states"])
        ]
        return super().load_optimizer_state_dict(owned)

    def _gather_objects(self, obj: Any) -> Optional[list[Any]]:
        """Every rank's ``obj`` on rank 0 (``None`` elsewhere): only rank 0 writes the checkpoint. Tensors travel
        as raw bytes (wire.py): pickled, they would go through ``torch.save`` on every rank, where Lightning's DDP
        calls it on rank 0 only."""
        if not (dist.is_available() and dist.is_initialized()):
            return [obj]
        out: Optional[list[Any]] = [None] * dist.get_world_size() if self.global_rank == 0 else None
        dist.gather_object(wire.pack(obj), out, dst=0)
        return [wire.unpack(o) for o in out] if out is not None else None


__all__ = ["CHECKPOINT_KEY", "CheckpointParts"]
