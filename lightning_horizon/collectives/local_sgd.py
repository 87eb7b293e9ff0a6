"""Hierarchical local SGD: gradients reduced inside the node every step, parameters averaged across nodes every k
(or stepped by DiLoCo's outer optimizer, the exchange overlapped with the next period: outer.py).

Past 16 nodes the inter-node allreduce of every step dominates; reducing inside the node only, and averaging the
parameters across nodes every ``k`` optimizer steps, divides the inter-node traffic by about ``k`` (post-local
SGD, Lin et al. 2020). The first ``warmup_steps`` steps still reduce gradients across the world, because early
training is the most sensitive to the nodes drifting apart.

The average is over the true weights (``TrainingState``: an fp32 master, or a bf16 weight plus its Kahan
compensation), so that every rank's true weights are identical after every sync. All ranks of a node hold
bitwise-equal parameters (same reduced gradients, same optimizer), so the average needs
no reduce-scatter: each local rank averages its own 1/L slice of the flattened parameters across nodes, then the
node all-gathers the slices, the same path as the hierarchical allreduce.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_horizon.collectives.comm import Comm
from lightning_horizon.collectives.chunks import row_slice
from lightning_horizon.collectives.outer import OuterSync
from lightning_horizon.parts import CheckpointStep
from lightning_horizon.state import TrainingState


class PeriodicSync:
    """The step counter of local SGD, and the cross-node parameter average it triggers."""

    def __init__(
        self,
        every: int,
        warmup_steps: int,
        params: list[torch.Tensor],
        row: Comm,
        col: Comm,
        state: TrainingState,
        outer: Optional[OuterSync] = None,
    ) -> None:
        self.every, self.warmup_steps = every, warmup_steps
        self.params = params
        #: the owner of the true weights: the average is taken over them (fp32 masters, bf16 + compensation),
        #: not over the module's rounded parameters
        self.state = state
        self.row, self.col = row, col
        #: optimizer steps taken after a gradient reduction (checkpointed: the warm-up and phase survive a resume)
        self.step = 0
        #: parameter averages done so far
        self.syncs = 0
        self._reduced = False
        #: DiLoCo's outer step instead of the plain average (``outer="nesterov"`` or ``sync_overlap=True``)
        self.outer = outer

    @property
    def global_gradients(self) -> bool:
        """Whether this step's gradients are reduced across the world (warm-up) or only inside the node."""
        return self.step < self.warmup_steps

    def gradients_reduced(self) -> None:
        """Called by the hook: the coming optimizer step follows a reduction (not an accumulation micro-step). The
        first local step's reduction, before its optimizer step, is where the outer step's anchor is taken: every
        node holds the same weights there (the initial ones, or the warm-up's)."""
        self._reduced = True
        if self.outer is not None and self.outer.anchor is None and self.step == self.warmup_steps:
            self.outer.start()

    def after_optimizer_step(self) -> bool:
        """Count the step; average the parameters across nodes when the period ends. True when it averaged."""
        if not self._reduced:
            return False
        self._reduced = False
        self.step += 1
        if self.step > self.warmup_steps and (self.step - self.warmup_steps) % self.every == 0:
            self.average_parameters()
            return True
        return False

    def average_parameters(self) -> None:
        self.syncs += 1
        if self.col.size == 1:
            return  # one node: nothing to average
        if self.outer is not None:
            self.outer.step()
        else:
            self.state.average(self.params, self._allreduce_mean)

    def _allreduce_mean(self, flat: torch.Tensor) -> None:
        """Average ``flat`` across nodes in place: each local rank averages its 1/L slice, the node gathers them."""
        padded, mine = row_slice(flat, self.row.size, self.row.index)
        mine = mine.clone()
        self.col.allreduce(mine)
        mine.div_(self.col.size)
        self.row.all_gather(padded, mine)
        flat.copy_(padded[: flat.numel()])

    def state_dict(self) -> dict:
        out: dict = {"step": self.step, "syncs": self.syncs}
        if self.outer is not None:
            out["outer"] = self.outer.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.step, self.syncs = int(state["step"]), int(state["syncs"])
        if self.outer is not None and state.get("outer") is not None:
            self.outer.load_state_dict(state["outer"])


# ---------------------------------------------------------------------- checkpoints between averages

NODE_KEY = "node"


class NodeWeightsCheckpoint(CheckpointStep):
    """Between two averages every node has its own weights, optimizer state and precision state, while Lightning
    writes rank 0's only: the first rank of every other node adds its node's to its gathered entry, and a rank
    resumed in the same layout takes its own node's back (the weights once setup built the module: DDP's
    constructor broadcasts rank 0's)."""

    rank_keys = (NODE_KEY,)

    def __init__(self) -> None:
        self.this_nodes_weights: Optional[dict[str, Any]] = None  # this node's, from the loaded checkpoint, for setup

    def save(self, strategy: Any, checkpoint: dict[str, Any], filepath: Any, rank_entry: dict[str, Any]) -> dict:
        t = strategy.topology
        if strategy.nodes_diverge and t.local_rank == 0 and t.node_rank > 0:
            keys = ("state_dict", "optimizer_states", type(strategy.precision_plugin).__qualname__)
            rank_entry[NODE_KEY] = {k: checkpoint[k] for k in keys if k in checkpoint}
        return {}

    def load(self, strategy: Any, checkpoint: dict[str, Any], saved: dict[str, Any], path: Any,
             same_layout: bool) -> dict[str, Any]:
        t = strategy.topology
        node = saved["ranks"][t.node_rank * t.ranks_per_node].get(NODE_KEY) if same_layout else None
        if not (strategy.nodes_diverge and node):
            return checkpoint
        self.this_nodes_weights = node.get("state_dict")
        return {**checkpoint, **node}  # Lightning restores the weights, optimizer and precision state from it

    def after_setup(self, strategy: Any) -> None:
        if self.this_nodes_weights is not None:
            strategy.lightning_module.load_state_dict(self.this_nodes_weights)
            self.this_nodes_weights = None
