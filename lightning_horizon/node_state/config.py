"""``HorizonStrategy(state=...)``: where the training state lives. Each field is the strategy's keyword of the same
name, checked when the strategy is built (the Trainer's constructor); what ``"node_sharded"`` cannot run with (other
options' values) is refused by the strategy's options (options.py), which see them all."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Union

from lightning_horizon.checks import check_one_of, is_int, require

OWNER = "HorizonStrategy"
STATES = ("replicated", "node_sharded")
NODE_WEIGHTS = ("shared", "copies")
STATE_CHECKPOINTS = ("full", "per_rank")


@dataclass(frozen=True)
class NodeStateConfig:
    """One replica of the state per rank, or one per node (see docs/node_state.md)."""

    state: str = "replicated"
    """``"replicated"`` (every rank holds the whole state, as DDP) or ``"node_sharded"`` (one copy of the weights per
    node, the rest owned in shares by the node's ranks)."""

    node_weights: str = "shared"
    """With ``"node_sharded"``: ``"shared"`` (the node's one copy in ``/dev/shm``) or ``"copies"`` (one per rank)."""

    state_checkpoint: str = "full"
    """With ``"node_sharded"``: ``"full"`` (rank 0 writes all) or ``"per_rank"`` (each rank its share)."""

    shard_group_nodes: Union[str, int] = "auto"
    """With ``"node_sharded"``: the nodes that together hold one copy of the state (masters, gradients, optimizer
    state), a divisor of the node count; ``"auto"``: the largest divisor up to a quarter of the nodes (1 below 8
    nodes: each node holds a copy)."""

    def __post_init__(self) -> None:
        check_one_of(OWNER, "state", self.state, STATES)
        check_one_of(OWNER, "node_weights", self.node_weights, NODE_WEIGHTS)
        check_one_of(OWNER, "state_checkpoint", self.state_checkpoint, STATE_CHECKPOINTS)
        require(self.shard_group_nodes == "auto" or is_int(self.shard_group_nodes, 1), OWNER, "shard_group_nodes",
                self.shard_group_nodes, "'auto' or an int >= 1 dividing the number of nodes")
        if self.state != "node_sharded":
            for f in fields(self):
                value = getattr(self, f.name)
                if f.name != "state" and value != f.default:
                    raise ValueError(f"{f.name}={value!r} with state={self.state!r}: an option of"
                                     f" state='node_sharded'; leave it at {f.default!r} or pass state='node_sharded'")

    @property
    def sharded(self) -> bool:
        return self.state == "node_sharded"

    def check_nodes(self, nodes: int) -> None:
        """``shard_group_nodes`` divides the number of nodes (known once the world is)."""
        k = self.shard_group_nodes
        if k != "auto" and nodes % k:
            raise ValueError(f"{OWNER}(shard_group_nodes={k!r}) on {nodes} node{'s' if nodes > 1 else ''}: must"
                             f" divide the number of nodes; allowed are"
                             f" {[d for d in range(1, nodes + 1) if nodes % d == 0]} or 'auto'")


__all__ = ["NODE_WEIGHTS", "NodeStateConfig", "STATES", "STATE_CHECKPOINTS"]
