"""Node-sharded training state (``HorizonStrategy(state="node_sharded")``): one copy of the weights per node in shared
memory, and each rank of a shard group (one node, or ``shard_group_nodes`` nodes) the owner of a share of the
parameters: their gradients, optimizer state and masters.

ownership.py (buckets and owners), shared_params.py (the weights in /dev/shm), reduce.py (the gradient path),
broadcast_params.py (updated weights to the copies that need them), checkpoint.py (full checkpoints in and out),
optimizers.py (which optimizers can step shards), clipping.py (norm clipping by the whole gradient's norm),
accounting.py (the memory table, the model at scale), part.py (NodeState, the strategy part that ties them together).
See docs/node_state.md.
"""

from lightning_horizon.node_state import checkpoint
from lightning_horizon.node_state.accounting import at_scale, state_bytes, table
from lightning_horizon.node_state.optimizers import PER_PARAMETER
from lightning_horizon.node_state.ownership import Bucket, Owners, plan_buckets, resolve_group_nodes
from lightning_horizon.node_state.part import NodeState

__all__ = ["Bucket", "NodeState", "Owners", "PER_PARAMETER", "at_scale", "checkpoint", "plan_buckets",
           "resolve_group_nodes", "state_bytes", "table"]
