"""What HorizonStrategy adds to Lightning's checkpoints: an object the strategy holds (``strategy.checkpoints``) and
calls from its ``save_checkpoint``, ``remove_checkpoint``, ``load_checkpoint``, ``load_optimizer_state_dict`` and
``setup``.

Every rank calls ``save_checkpoint``; the parts' state differs per rank (RNG, error feedback, plans), so it is gathered
to rank 0, which writes it under one key (``"HorizonStrategy"``: the world size and one dict per rank). What a
capability splits of Lightning's own entries (a node's weights under local SGD, the owners' shares of node-sharded
state) is its checkpoint step's (parts.CheckpointStep, listed by fit_parts.py), called here at each point in turn.
Loading hands each rank its own part states; into another world size only what is whole for any layout.

It reads the strategy's public side only and names no part.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn

from lightning_horizon import wire
from lightning_horizon.parts import CheckpointStep

log = logging.getLogger("lightning_horizon.strategy")

CHECKPOINT_KEY = "HorizonStrategy"


class StrategyCheckpoint:
    """The strategy's checkpoint side: what a save adds (every rank), what a load hands back."""

    def __init__(self, strategy: Any, steps: Sequence[CheckpointStep]) -> None:
        self.strategy = strategy
        #: the capabilities' checkpoint steps, called in this order
        self.steps = tuple(steps)

    def after_setup(self) -> None:
        """The end of setup: each step finishes what a load left for the built module."""
        for step in self.steps:
            step.after_setup(self.strategy)

    def before_write(self, checkpoint: dict[str, Any], filepath: Any) -> dict[str, Any]:
        """Called on every rank before rank 0 writes ``checkpoint``; the parts' state differs per rank (RNG, error
        feedback, plans), so it is gathered to rank 0 into the checkpoint. Returns the checkpoint to write, the
        training data's positions in the strategy's entry (data_position.py: plain Lightning can resume it)."""
        s = self.strategy
        s.parts.before_save(s.model)  # e.g. the bucket layout the next step reduces in (collective)
        states = s.parts.state_dicts()
        entry: dict[str, Any] = {}
        for step in self.steps:
            entry.update(step.save(s, checkpoint, filepath, states))
        free = s.parts.layout_free()  # whole on rank 0, empty elsewhere: saved once, for any layout
        ranks = self.gather_objects({k: v for k, v in states.items() if k not in free})
        if ranks is not None:
            checkpoint[CHECKPOINT_KEY] = {"world_size": s.world_size, "ranks": ranks, **entry,
                                          "layout_free": {k: states[k] for k in free}}
        return s.data_positions.portable(checkpoint, CHECKPOINT_KEY)

    def after_remove(self, filepath: Any) -> None:
        for step in self.steps:
            step.removed(self.strategy, filepath)

    def after_read(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> dict[str, Any]:
        """The loaded ``checkpoint`` as Lightning will restore it: each part gets this rank's state, and each step
        its part of the restore (files merged back, this node's weights)."""
        s = self.strategy
        checkpoint = s.data_positions.restored(checkpoint, CHECKPOINT_KEY)
        saved = checkpoint.get(CHECKPOINT_KEY)
        trainer = getattr(s.lightning_module, "_trainer", None)
        if saved is None or not (trainer is None or trainer.state.fn == TrainerFn.FITTING):
            # validate/test/predict(ckpt_path=...) take the weights only, as under DDP: the per-rank state (RNG, error
            # feedback, plans) is for resuming training, and restoring the RNG would move the user's draws
            return checkpoint
        free = saved.get("layout_free", {})  # every rank's, whatever the layout
        same_layout = saved["world_size"] == s.world_size
        if same_layout:
            # parts that exist get their state now, the others when setup creates them
            own = {k for step in self.steps for k in step.rank_keys}
            s.parts.load_state_dicts({**{k: v for k, v in saved["ranks"][s.global_rank].items() if k not in own},
                                      **free})
        else:
            log.warning(
                f"HorizonStrategy: checkpoint saved with world size {saved['world_size']}, resuming with"
                f" {s.world_size}: per-rank state (RNG, collectives, sharding) starts fresh; the training data"
                " resumes at its global position"
            )
            s.parts.load_state_dicts(free)
        for step in self.steps:
            checkpoint = step.load(s, checkpoint, saved, checkpoint_path, same_layout)
        return checkpoint

    def optimizer_states(self, checkpoint: Any) -> Any:
        """The checkpoint whose optimizer states this rank loads (a step may keep what this rank holds)."""
        for step in self.steps:
            checkpoint = step.optimizer_states(self.strategy, checkpoint)
        return checkpoint

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
