"""NodeState: ``HorizonStrategy(state="node_sharded")`` on one rank, a strategy part.

It plans the buckets and their owners in the shard group (ownership.py), moves the parameters into the node's shared
memory (shared_params.py; or keeps a copy per rank that the owners update by broadcast, broadcast_params.py), installs
the gradient path (reduce.py) and tells the training state which parameters this rank steps, so that the precision
policy keeps masters for those only and the gradient norm is summed over the shard group; every norm clipping takes
that norm (clipping.py). Where the shard group spans several nodes, the owners' updates reach its other nodes by
broadcast after each step (broadcast_params.py). The strategy calls it around each backward and after each optimizer
step; checkpoints are merged and filtered by checkpoint.py, by this part's ownership, also after the fit.
"""

from __future__ import annotations

import logging
import uuid
from types import MappingProxyType
from typing import Any, Optional, Union

import torch.distributed as dist
from torch import Tensor, nn

from lightning_horizon.node_state.accounting import state_bytes, table
from lightning_horizon.node_state.broadcast_params import BroadcastParameters, ParameterBroadcast, group_broadcast
from lightning_horizon.node_state.clipping import clip, warn_direct_clipping
from lightning_horizon.node_state.optimizers import why_not
from lightning_horizon.node_state.ownership import Bucket, Owners, plan_buckets
from lightning_horizon.node_state.reduce import OwnerReduce
from lightning_horizon.node_state.shared_params import SharedParameters
from lightning_horizon.optim import torch_optimizer
from lightning_horizon.parts import GRADIENTS, PARAMETERS, Part
from lightning_horizon.precision import HorizonPrecision
from lightning_horizon.state import TrainingState
from lightning_horizon.topology import ProcessGroups

log = logging.getLogger(__name__)


class NodeState(Part):
    """One copy of the weights per node, optimizer state and gradients split between the node's ranks."""

    label = "HorizonStrategy(state='node_sharded')"
    takes = MappingProxyType({PARAMETERS: "one copy per node, owned in shares",
                              GRADIENTS: "each bucket reduced to its owner, then across nodes"})

    def __init__(self, module: nn.Module, groups: ProcessGroups, cap_bytes: int, training_state: TrainingState,
                 precision: Any = None, weights: str = "shared", group_nodes: int = 1) -> None:
        """Collective (it may create the shard group's process groups): every rank, at the same point.
        ``group_nodes``: the nodes of a shard group, which together hold one copy of the state."""
        self.topology = t = groups.topology
        self.groups = groups
        self.shard_group = groups.shard_group(group_nodes)
        #: the places of the shard group and this rank's
        self.owners = Owners(ranks_per_node=t.ranks_per_node, nodes=group_nodes, rank=t.rank)
        trainable = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]
        self.buckets: list[Bucket] = plan_buckets(trainable, self.owners.count, cap_bytes)
        self._owner = {p: b.owner for b in self.buckets for p in b.params}  # kept after teardown: saving after fit
        #: how the node's ranks see the owners' updates: one shared copy ("shared") or a copy each ("copies")
        self.weights_mode = weights
        self.weights: Union[SharedParameters, BroadcastParameters] = (
            SharedParameters(module, groups.intra, groups.inter if t.local_rank == 0 else None,
                             t.local_rank, t.node_rank, training_state)
            if weights == "shared" else BroadcastParameters(module, self.buckets, groups.intra, t, self.owners)
        )
        self.group_weights = (group_broadcast(self.buckets, self.owners, self.shard_group.peers)
                              if group_nodes > 1 else None)
        self.training_state = training_state
        self.reducer: Optional[OwnerReduce] = None
        # HorizonPrecision's stochastic rounding draws for this rank's parameters only: its generators differ per
        # rank and are saved here, per rank (the checkpoint's precision state holds rank 0's)
        self._precision = precision if isinstance(precision, HorizonPrecision) else None
        self._rounding: Optional[dict[str, Any]] = None  # loaded, applied before the next optimizer step

    def install(self) -> None:
        """Collective: every rank, at the same point of setup, before the optimizers and the precision connect."""
        token = [uuid.uuid4().hex if self.topology.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        self.weights.install(token[0])
        self.reducer = OwnerReduce(self.buckets, self.topology, self.owners, self.shard_group)
        self.training_state.shard(self.owns, self.shard_group.members)

    def refuses(self, optimizer: Any) -> Optional[str]:
        return why_not(optimizer)

    def connect(self, trainer: Any, module: nn.Module, optimizers: list[Any]) -> None:
        """Once the optimizers exist (every rank): optimizers it can step, holding state for this rank's parameters
        only, a warning for a clip that cannot see the whole gradient, rank 0's buffers (DDP's constructor broadcasts
        them), the memory table."""
        for opt in optimizers:
            opt = torch_optimizer(opt)
            for p in [p for p in opt.state if not self.owns(p)]:
                del opt.state[p]  # made eagerly (Adagrad's constructor); this rank never steps it
        warn_direct_clipping(module)
        for b in module.buffers():
            dist.broadcast(b, src=0)
        if self.topology.rank == 0:
            figures = state_bytes(module, optimizers, trainer.precision_plugin, self.topology.ranks_per_node,
                                  lambda p: self._owner.get(p, 0), weights_shared=self.weights_mode == "shared",
                                  group_nodes=self.owners.nodes)
            log.info(table(figures, self.topology.ranks_per_node, self.owners.nodes))

    def owns(self, p: Tensor) -> bool:
        """Whether this rank steps ``p`` (a parameter or its master) and holds its state; a parameter outside the
        buckets (frozen) is every rank's. Answers after teardown too (the shares a checkpoint gathers)."""
        owner = self._owner.get(self.training_state.parameter_of(p))
        return owner is None or owner == self.owners.me

    @property
    def in_first_shard_group(self) -> bool:
        """Whether this rank is one of the ranks ``0 .. owners.count - 1``, which together hold the whole state
        (the ranks a checkpoint takes it from; the rank's place is its global rank)."""
        return self.topology.rank < self.owners.count

    def owner_loads(self) -> list[int]:
        """Bytes of parameters each place of the shard group owns."""
        loads = [0] * self.owners.count
        for b in self.buckets:
            loads[b.owner] += b.nbytes
        return loads

    # ------------------------------------------------------------------ the step

    def clip_gradients(self, plugin: Any, optimizer: Any, clip_val: float, algorithm: Any) -> bool:
        return clip(plugin, self.training_state, optimizer, clip_val, algorithm)  # by the whole gradient's norm

    def pre_backward(self, sync: bool) -> None:
        assert self.reducer is not None
        self.reducer.pre_backward(sync)

    def post_backward(self) -> None:
        assert self.reducer is not None
        self.reducer.post_backward()

    def gradients_ready(self) -> None:
        assert self.reducer is not None
        self.reducer.settle()
        if self._rounding is not None and self._precision is not None:
            # after Lightning restored the precision state (rank 0's generators), before the step draws
            self._precision.load_rounding_state(self._rounding)
        self._rounding = None

    def optimizer_stepped(self, optimizer: Any) -> None:
        """The owners' updates reach every node of the shard group, then every rank of the node, before any of them
        reads the weights again."""
        if self.group_weights is not None:
            self.group_weights.send()
        self.weights.after_step()

    def comm_metrics(self) -> dict[str, float]:
        """The last step's bytes this rank sent (gradients to their owners, the owners' updates to the node's
        ranks and to the shard group's other nodes), seconds it waited for them, messages and collectives."""
        r = self.reducer
        if r is None:
            return {}
        intra, inter, seconds, calls = r.bytes_intra, r.bytes_inter, r.seconds, r.calls
        for sender, inside in ((self.weights, True), (self.group_weights, False)):
            if isinstance(sender, (BroadcastParameters, ParameterBroadcast)):
                intra, inter = (intra + sender.bytes_sent, inter) if inside else (intra, inter + sender.bytes_sent)
                seconds, calls = seconds + sender.seconds, calls + sender.calls
        return {"comm/intra_bytes": intra, "comm/inter_bytes": inter, "comm/seconds": seconds,
                "comm/calls": float(calls)}

    def state_dict(self) -> dict[str, Any]:
        return {"rounding": self._precision.rounding_state()} if self._precision is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rounding = state.get("rounding")

    def teardown(self) -> None:
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        self.weights.uninstall()
        if self.group_weights is not None:
            self.group_weights.clear()
        self.training_state.unshard()


__all__ = ["NodeState"]
