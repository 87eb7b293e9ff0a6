"""Node-sharded training state (``HorizonStrategy(state="node_sharded")``): one copy of the weights per node in shared
memory, and each local rank the owner of a share of the parameters: their gradients, optimizer state and masters.

ownership.py (buckets and owners), shared_params.py (the weights in /dev/shm), reduce.py (the gradient path),
checkpoint.py (full checkpoints in and out), optimizers.py (which optimizers can step shards), clipping.py (norm
clipping by the whole gradient's norm), accounting.py (the memory table), part.py (NodeState, the strategy part that
ties them together). See docs/node_state.md.
"""

from lightning_horizon.node_state import checkpoint
from lightning_horizon.node_state.accounting import state_bytes, table
from lightning_horizon.node_state.optimizers import PER_PARAMETER
from lightning_horizon.node_state.ownership import Bucket, plan_buckets
from lightning_horizon.node_state.part import NodeState

__all__ = ["Bucket", "NodeState", "PER_PARAMETER", "checkpoint", "plan_buckets", "state_bytes",
           "table"]
