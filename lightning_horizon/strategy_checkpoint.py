"""What HorizonStrategy adds to Lightning's checkpoints: an object the strategy holds (``strategy.checkpoints``) and
calls from its ``save_checkpoint``, ``remove_checkpoint``, ``load_checkpoint`` and ``load_optimizer_state_dict``.

Every rank calls ``save_checkpoint``; the parts' state differs per rank (RNG, error feedback, plans), so it is gathered
to rank 0, which writes it under one key (``"HorizonStrategy"``: the world size and one dict per rank). Under local
SGD each node's weights travel along (collectives/local_sgd.py); under node-sharded state each rank's share of the
optimizer state and masters is gathered into the dicts a replicated run writes, or written to per-rank files
(node_state/checkpoint.py), also when ``trainer.save_checkpoint`` runs after fit (the optimizers still hold the
shares then). Loading hands each rank its own part states and, node-sharded, its own share.

It reads the strategy's public side only: ``parts``, ``node_state``, ``node_shares``, ``topology``, ``nodes_diverge``,
``options``, the module, optimizers, precision plugin, ranks and ``barrier``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn

from lightning_horizon import wire
from lightning_horizon.collectives.local_sgd import NODE_KEY, node_state, this_nodes_checkpoint
from lightning_horizon.node_state import checkpoint as node_checkpoint

log = logging.getLogger("lightning_horizon.strategy")

CHECKPOINT_KEY = "HorizonStrategy"


class StrategyCheckpoint:
    """The strategy's checkpoint side: what a save adds (every rank), what a load hands back."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        #: under local SGD, this node's weights from the loaded checkpoint, for the module once setup built it
        self.node_weights: Optional[dict[str, Any]] = None

    def restore_node_weights(self, module: Any) -> None:
        """Under local SGD, give ``module`` (built by setup) this node's weights from the loaded checkpoint, once."""
        if self.node_weights is not None:
            module.load_state_dict(self.node_weights)
            self.node_weights = None

    def before_write(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """Called on every rank before rank 0 writes ``checkpoint``; the parts' state differs per rank (RNG, error
        feedback, plans), so it is gathered to rank 0 into the checkpoint."""
        s = self.strategy
        s.parts.before_save(s.model)  # e.g. the bucket layout the next step reduces in (collective)
        shares = s.node_shares
        files = self._save_node_state(checkpoint, filepath, shares) if shares is not None else 0
        states = s.parts.state_dicts()
        if shares is not None and shares is not s.node_state:
            states["node_state"] = shares.state_dict()  # after fit: its per-rank state, as a save at the fit's end
        if s.nodes_diverge and s.topology.local_rank == 0 and s.topology.node_rank > 0:
            states[NODE_KEY] = node_state(checkpoint, type(s.precision_plugin).__qualname__)
        free = s.parts.layout_free()  # whole on rank 0, empty elsewhere: saved once, for any layout
        ranks = self.gather_objects({k: v for k, v in states.items() if k not in free})
        if ranks is not None:
            checkpoint[CHECKPOINT_KEY] = {"world_size": s.world_size, "ranks": ranks, "state_files": files,
                                          "layout_free": {k: states[k] for k in free}}

    def _save_node_state(self, checkpoint: dict[str, Any], filepath: Any, shares: Any) -> int:
        """Each rank holds its parameters' optimizer state and masters (the first shard group's ranks, 0 .. n - 1,
        hold everything; the others send nothing): gathered into rank 0's checkpoint, as one replicated run writes
        it, or written by each of them to its own file (``state_checkpoint="per_rank"``). Returns the number of such
        files."""
        s = self.strategy
        key = type(s.precision_plugin).__qualname__
        mine = None
        if shares.in_first_shard_group:
            names = dict(s.lightning_module.named_parameters())
            mine = node_checkpoint.local_part(checkpoint, key, s.optimizers, names, shares.owns)
        if s.options.node_state.state_checkpoint == "full" or "optimizer_states" not in checkpoint:
            parts = self.gather_objects(mine)
            if parts is not None:
                node_checkpoint.merge(checkpoint, [p for p in parts if p is not None], key)
            return 0
        if mine is not None:
            node_checkpoint.write_part(mine, filepath, s.topology.rank)
        s.barrier("per-rank state written")  # before rank 0 writes the checkpoint that names the files
        node_checkpoint.strip(checkpoint, key)
        return shares.owners.count

    def after_remove(self, filepath: Any) -> None:
        if self.strategy.is_global_zero:
            node_checkpoint.remove_parts(filepath)  # a per-rank checkpoint's folder goes with it

    def after_read(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> dict[str, Any]:
        """The loaded ``checkpoint`` as Lightning will restore it: each part gets this rank's state, node-sharded
        per-rank files are merged back, under local SGD this node's weights are the ones restored."""
        s = self.strategy
        saved = checkpoint.get(CHECKPOINT_KEY)
        trainer = getattr(s.lightning_module, "_trainer", None)
        fitting = trainer is None or trainer.state.fn == TrainerFn.FITTING
        if fitting and saved is not None and saved.get("state_files") and "optimizer_states" in checkpoint:
            # saved per rank (node-sharded): back into the dicts a full checkpoint has, whatever this run's layout
            key = type(s.precision_plugin).__qualname__
            node_checkpoint.merge(checkpoint, node_checkpoint.read_parts(checkpoint_path, saved["state_files"]), key)
        if saved is None or not fitting:
            # validate/test/predict(ckpt_path=...) take the weights only, as under DDP: the per-rank state (RNG, error
            # feedback, plans) is for resuming training, and restoring the RNG would move the user's draws
            return checkpoint
        free = saved.get("layout_free", {})  # every rank's, whatever the layout
        if saved["world_size"] != s.world_size:
            log.warning(
                f"HorizonStrategy: checkpoint saved with world size {saved['world_size']}, resuming with"
                f" {s.world_size}: per-rank state (RNG, collectives, sharding) starts fresh; the training data"
                " resumes at its global position"
            )
            s.parts.load_state_dicts(free)
            return checkpoint
        # parts that exist get their state now, the others when setup creates them
        s.parts.load_state_dicts({**{k: v for k, v in saved["ranks"][s.global_rank].items() if k != NODE_KEY},
                                  **free})
        if s.nodes_diverge:
            # Lightning restores the weights, optimizer and precision state from this dict: give it this node's
            checkpoint, self.node_weights = this_nodes_checkpoint(
                checkpoint, saved["ranks"], s.topology.node_rank, s.topology.ranks_per_node
            )
        return checkpoint

    def optimizer_states(self, checkpoint: Any) -> Any:
        """The checkpoint whose optimizer states this rank loads: under node-sharded state (a full checkpoint, any
        layout) each rank takes the state of the parameters it owns, nothing more."""
        node = self.strategy.node_state
        if node is None:
            return checkpoint
        owned = dict(checkpoint)
        owned["optimizer_states"] = [
            node_checkpoint.owned_optimizer_state(s, [p for g in opt.param_groups for p in g["params"]], node.owns)
            for opt, s in zip(self.strategy.optimizers, checkpoint["optimizer_states"])
        ]
        return owned

    def gather_objects(self, obj: Any) -> Optional[list[Any]]:
        """Every rank's ``obj`` on rank 0 (``None`` elsewhere): only rank 0 writes the checkpoint. Tensors travel
        as raw bytes (wire.py): pickled, they would go through ``torch.save`` on every rank, where Lightning's DDP
        calls it on rank 0 only."""
        if not (dist.is_available() and dist.is_initialized()):
            return [obj]
        out: Optional[list[Any]] = [None] * dist.get_world_size() if self.strategy.global_rank == 0 else None
        dist.gather_object(wire.pack(obj), out, dst=0)
        return [wire.unpack(o) for o in out] if out is not None else None


__all__ = ["CHECKPOINT_KEY", "StrategyCheckpoint"]
