"""The strategy part of the sharded embedding tables: placed before DDP, stepped sparsely inside the user's step.

Its rows in the lifecycle (parts.py):

- born before DDP wraps the module (fit_parts.py): every :class:`ShardedEmbeddingBag` keeps its rows
  (:meth:`ShardedEmbeddingBag.place`, over a process group of the tables' own; a ``placement="table"`` table
  whole on one rank, :func:`table_owners`) and its parameter is kept out of DDP (its gradient never crosses the
  wire; the lookups do); a ``span="auto"`` table on several nodes goes over the world with a
  :class:`~lightning_horizon.embedding.span.SpanChoice`, which its first lookup makes;
- ``connect``: each table must sit in one of the user's optimizers (its parameter groups' learning-rate schedule and
  GradNormBackoff's decisions then apply to it); that optimizer's state for it, if it made one eagerly (Adagrad),
  is dropped; the table's gradient is registered with the training state, so the global norm, clipping and a
  skip count it;
- ``gradients_ready``: each table takes its gradient out of ``weight.grad`` before the optimizer reads them;
- the user's optimizer step: a post-hook of that optimizer steps the touched rows, while the step's lr is in
  place (the schedule's, times GradNormBackoff's backoff): the group's lr, or the table's own times the group's
  lr over its initial lr (sparse_optim.py);
- ``state_dict``: every table's optimizer state, whole on rank 0 (:attr:`layout_free`): it loads into any world
  size. The tables stay placed after the fit (validate, test, predict and ``trainer.save_checkpoint`` look them up
  over the ranks as the fit did).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_horizon.embedding.bag import ShardedEmbeddingBag
from lightning_horizon.embedding.span import SpanChoice
from lightning_horizon.node_state.clipping import clip
from lightning_horizon.optim import torch_optimizer
from lightning_horizon.parts import PARAMETERS, Part
from lightning_horizon.state import TrainingState


def tables_of(module: nn.Module) -> dict[str, ShardedEmbeddingBag]:
    """The module's sharded tables by name."""
    return {name: m for name, m in module.named_modules() if isinstance(m, ShardedEmbeddingBag)}


class EmbeddingTables(Part):
    """The sharded tables of one module: placement, their gradients' way to the norm, their sparse step."""

    label = "ShardedEmbeddingBag"
    takes = MappingProxyType({PARAMETERS: "the tables' rows, sharded over the ranks"})
    layout_free = True

    def __init__(self, module: nn.Module, training_state: TrainingState, topology: Any,
                 groups: Optional[TableGroups], links: Optional[Callable[[], Any]] = None) -> None:
        """``topology``: the strategy's (ranks, nodes); ``groups``: the tables' process groups (``None``: one
        process); ``links``: the link constants for ``span="auto"`` (a ``CostModel``; collective where it
        probes)."""
        self.tables = tables_of(module)
        self.training_state = training_state
        self.topology, self.groups, self._probe = topology, groups, links
        self._links: Optional[Any] = None
        self._hooks: list[Any] = []
        self._at_start: Optional[tuple[float, ...]] = None  # the tables' bytes, seconds, messages as a step began
        self._last = (0.0, 0.0, 0.0)  # the last step's

    def place(self, model: nn.Module) -> None:
        """Keep this rank's rows of every table, and keep the tables out of DDP (before it wraps ``model``; with
        one process too: what DDP ignores, no part expects a gradient of)."""
        mine = {id(t.weight) for t in self.tables.values()}
        ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
        names = [n for n, p in model.named_parameters() if id(p) in mine and n not in ignored]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored + names)
        t, g = self.topology, self.groups
        if g is None:
            return
        # on one node every span is the world; on several, "auto" starts over the world and may move (span.py)
        spans = {n: x.span if t.num_nodes > 1 and not (x.span == "auto" and x.rows_on_disk is not None) else "world"
                 for n, x in self.tables.items()}  # a table on disk is not moved: "auto" keeps it spread
        world_owners = table_owners({n: x for n, x in self.tables.items() if spans[n] != "node"}, t.world_size)
        node_owners = table_owners({n: x for n, x in self.tables.items() if spans[n] != "world"}, t.ranks_per_node)
        for name, table in self.tables.items():
            node_layout = (t.local_rank, t.ranks_per_node, g.node, node_owners.get(name),
                           (t.node_rank, t.num_nodes, g.across))
            if spans[name] == "node":  # a copy per node, spread over its ranks
                table.place(*node_layout[:4], replicas=node_layout[4])
            else:
                choice = SpanChoice(name, t, node_layout, self.links) if spans[name] == "auto" else None
                table.place(t.rank, t.world_size, g.world, world_owners.get(name), choice=choice)

    def links(self) -> Any:
        """The link constants, probed (collective) once for all the tables, at the first table's first lookup."""
        if self._links is None:
            self._links = self._probe()
        return self._links

    def refuses(self, optimizer: Any) -> Optional[str]:
        if isinstance(optimizer, torch.optim.LBFGS) and self._holds(optimizer):
            return ("LBFGS evaluates its closure several times per step; a sharded table steps once, with its own"
                    " sparse optimizer (keep the table out of LBFGS's parameters)")
        return None

    def connect(self, trainer: Any, module: nn.Module, optimizers: list[Any]) -> None:
        self.teardown()
        opts = [torch_optimizer(o) for o in optimizers]
        stepped: dict[Any, list[tuple[ShardedEmbeddingBag, int, float]]] = {}
        for name, table in self.tables.items():
            if table.weight.dtype not in (torch.float32, torch.float64):
                raise ValueError(
                    f"ShardedEmbeddingBag {name!r} keeps its table and optimizer state in float32 or float64; the"
                    f" precision plugin made it {table.weight.dtype} (use HorizonPrecision('bf16-mixed') or"
                    " 'auto': bf16 matmuls elsewhere, the table in fp32)")
            found = [(o, i) for o in opts for i, g in enumerate(o.param_groups)
                     if any(p is table.weight for p in g["params"])]
            if not found:
                raise ValueError(
                    f"ShardedEmbeddingBag {name!r} is in none of the optimizers: configure_optimizers must give it one"
                    " (e.g. self.parameters()); that optimizer never steps the table itself, its sparse optimizer"
                    f" ({table.optimizer}) does, with the group's learning-rate schedule, clipping and skips")
            opt, index = found[0]
            opt.state.pop(table.weight, None)  # eager state (Adagrad's) the optimizer will never use
            group = opt.param_groups[index]  # by index at each step: loading a state replaces the group dicts
            stepped.setdefault(opt, []).append((table, index, float(group.get("initial_lr", group["lr"]))))
            self.training_state.register_sparse(table.weight, table)
        for opt, entries in stepped.items():
            self._hooks.append(opt.register_step_post_hook(lambda o, *_, e=entries: _step(o, e)))

    def gradients_ready(self) -> None:
        for table in self.tables.values():
            table.take_gradient()

    def clip_gradients(self, plugin: Any, optimizer: Any, clip_val: float, algorithm: Any) -> bool:
        """By norm: the norm and the clip count the tables' gradients (the training state's). By value: each
        table's gradient is clamped alike, then the plugin clips the rest. Either way the gradients are taken first
        (manual optimization clips before the step)."""
        held = [t for t in self.tables.values() if self._holds(torch_optimizer(optimizer), t)]
        if not held:
            return False
        for t in held:  # manual optimization clips before the step's gradients_ready
            t.take_gradient()
        if algorithm == GradClipAlgorithmType.VALUE:
            for t in held:
                t.clamp_gradient(clip_val)
            return False
        return clip(plugin, self.training_state, optimizer, clip_val, algorithm)

    def _traffic(self) -> tuple[float, ...]:
        tables = self.tables.values()
        return (float(sum(t.sent_bytes for t in tables)), sum(t.meter.seconds for t in tables),
                float(sum(t.meter.calls for t in tables)))

    def before_training_step(self, module: nn.Module, batch: Any, batch_idx: int, step_context: Any) -> None:
        if self._at_start is None:  # the step's first micro-batch: lookups of an evaluation in between don't count
            self._at_start = self._traffic()

    def after_optimizer_step(self) -> None:
        if self._at_start is not None:
            self._last = tuple(now - before for now, before in zip(self._traffic(), self._at_start))
            self._at_start = None

    def comm_metrics(self) -> dict[str, float]:
        """The last step's bytes this rank sent for the tables' lookups (and their gradients), the seconds and
        messages of those exchanges (nothing with one process: its tables send nothing)."""
        if self.groups is None:
            return {}
        sent, seconds, calls = self._last
        return {"comm/embedding_bytes": sent, "comm/seconds": seconds, "comm/calls": calls}

    def teardown(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.training_state.unregister_sparse()
        for table in self.tables.values():
            table.drop_gradient()

    def state_dict(self) -> dict[str, Any]:
        """Every table's optimizer state, whole, on rank 0 (collective: every rank calls it at each save)."""
        return {name: table.full_optimizer_state() for name, table in self.tables.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, saved in state.items():
            if name in self.tables and saved:
                self.tables[name].load_full_optimizer_state(saved)

    def _holds(self, optimizer: Any, table: Optional[ShardedEmbeddingBag] = None) -> bool:
        weights = [t.weight for t in ([table] if table is not None else self.tables.values())]
        return any(p is w for g in optimizer.param_groups for p in g["params"] for w in weights)


class TableGroups(NamedTuple):
    """The tables' process groups, of their own (never the default group DDP reduces on): every rank; this rank's
    node (``None`` on one node); this local rank on every node (``None`` on one node)."""

    world: Any
    node: Any
    across: Any


def table_groups(topology: Any) -> Optional[TableGroups]:
    """Every rank, at the same point (collective: each group is made by all ranks, in one order); ``None`` with one
    process."""
    if topology.world_size == 1:
        return None
    world = dist.new_group()
    if topology.num_nodes == 1:
        return TableGroups(world, None, None)
    nodes = [dist.new_group(topology.node_ranks(n)) for n in range(topology.num_nodes)]
    across = [dist.new_group(topology.cross_ranks(r)) for r in range(topology.ranks_per_node)]
    return TableGroups(world, nodes[topology.node_rank], across[topology.local_rank])


def table_owners(tables: dict[str, ShardedEmbeddingBag], world: int) -> dict[str, int]:
    """The rank of each ``placement="table"`` table: largest first, each to the rank holding the fewest rows x
    width of them so far (ties: the lowest rank); the same on every rank."""
    held, out = [0] * world, {}
    whole = [(n, t) for n, t in tables.items() if t.placement == "table"]
    for name, table in sorted(whole, key=lambda nt: -nt[1].num_embeddings * nt[1].embedding_dim):
        rank = held.index(min(held))
        out[name] = rank
        held[rank] += table.num_embeddings * table.embedding_dim
    return out


def _step(optimizer: Any, entries: list[tuple[ShardedEmbeddingBag, int, float]]) -> None:
    """After ``optimizer``'s step, while its lrs are the step's: each table's rows, at its group's lr (or at its own
    times the group's factor, sparse_optim.py)."""
    for table, index, initial in entries:
        lr = float(optimizer.param_groups[index]["lr"])
        own = table.optimizer.lr
        table.sparse_step(lr if own is None else own * (lr / initial if initial else 1.0))


__all__ = ["EmbeddingTables", "TableGroups", "table_groups", "table_owners", "tables_of"]
