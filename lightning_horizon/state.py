"""TrainingState: the one owner of the true weights.

A module parameter is not always the whole truth about a weight. Under ``HorizonPrecision("bf16-true")`` the
bf16 parameter is a rounded view of it: the true value is an fp32 master (``master="fp32"``) or the bf16 weight
plus a bf16 compensation holding the low bits (``master="kahan"``). Every part that reads, writes or averages
weights (local SGD's periodic average, checkpoints, tests comparing ranks) asks this object, never the module
or the precision plugin's storage: when local SGD averaged the bf16 parameters alone, each node's fp32 master
wrote its own value back over the average at the next step and the nodes never agreed again.

The precision policy registers where each parameter's truth lives; a parameter nobody registered is its own
truth (fp32 training, bf16-mixed).
"""

from __future__ import annotations

import functools
import math

from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_horizon.gradnorm import clip_grads_, total_norm_fp32

MODULE, MASTER, COMPENSATED = "module", "fp32 master", "bf16 + compensation"


def swap_in(tensor: Tensor, storage: Tensor) -> None:
    """``tensor`` (a meta parameter or tensor) becomes a tensor viewing ``storage``, the Python object kept."""
    new = torch.nn.Parameter(storage, requires_grad=tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) \
        else storage
    torch.utils.swap_tensors(tensor, new)


class TrainingState:
    """Where each parameter's true value lives, and how to read, write and average it."""

    def __init__(self) -> None:
        self._masters: dict[Tensor, Tensor] = {}  # module parameter -> fp32 master
        self._compensation: dict[Tensor, Tensor] = {}  # module parameter -> bf16 Kahan compensation
        self._param_of: dict[Tensor, Tensor] = {}  # fp32 master -> its module parameter
        self._owns: Optional[Callable[[Tensor], bool]] = None  # node-sharded state: the parameters this rank steps
        #: node-sharded state: the ranks the gradients are sharded over (each rank keeps those it owns); the
        #: gradient norm is all-reduced over it (``grad_norm``). ``None``: every rank holds every gradient.
        self.grad_group: Optional[Any] = None
        #: out-of-core training (lightning_horizon/store/): the StateStore that holds weights, gradients, masters
        #: and optimizer state in memory-mapped files; ``None``: they live where torch allocates them
        self.store: Optional[Any] = None
        #: parameter -> the table holding its sparse gradient (embedding/)
        self._sparse: dict[Tensor, Any] = {}

    # ------------------------------------------------------------------ ownership (node-sharded state)

    def shard(self, owns: Callable[[Tensor], bool], grad_group: Optional[Any]) -> None:
        """From now on this rank steps (and keeps masters, compensations, gradients and optimizer state for) only
        the parameters ``owns`` accepts; the others are stepped by another rank of ``grad_group``."""
        self._owns, self.grad_group = owns, grad_group

    def unshard(self) -> None:
        self._owns, self.grad_group = None, None

    def owns(self, param: Tensor) -> bool:
        """Whether this rank steps ``param`` (a module parameter or its master): always, unless state is sharded."""
        return self._owns is None or self._owns(self.parameter_of(param))

    def grad_norm(self, params: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
        """The fp32 norm of the whole gradient of ``params``, the same on every rank, also when each rank holds only
        the gradients it owns, and with the sparse gradients of the embedding tables among ``params``."""
        params = list(params)
        dense = total_norm_fp32(params, norm_type, self.grad_group, self.stream)
        by_group: dict[Any, list[Tensor]] = {}  # each copy's ranks hold its rows' gradients once: summed there
        for p in params:
            if p in self._sparse:
                table = self._sparse[p]
                by_group.setdefault(table.copy_group, []).append(table.gradient_share(norm_type).to(dense.dtype))
        if not by_group:
            return dense
        inf = math.isinf(norm_type)
        total = dense if inf else dense.pow(norm_type)
        for group, shares in by_group.items():  # every rank registered the same tables, in the same order
            share = torch.stack(shares).max() if inf else torch.stack(shares).sum()
            if group is not None:
                dist.all_reduce(share, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
            total = torch.maximum(total, share) if inf else total + share
        return total if inf else total.pow(1.0 / norm_type)

    def clip(self, params: list[Tensor], max_norm: float, total_norm: Tensor) -> float:
        """Scale the gradients of ``params`` (the tables' sparse ones too) in place to a total norm of at most
        ``max_norm``; returns the factor."""
        factor = clip_grads_(params, max_norm, total_norm, lambda ps: self.stream(ps, dirty=True))
        if factor != 1.0:
            coef = torch.tensor(factor, dtype=total_norm.dtype)  # exactly clip_grads_' (its dtype, as a float)
            for p in params:
                if p in self._sparse:
                    self._sparse[p].scale_gradient(coef)
        return factor

    def skip(self, params: Iterable[Tensor]) -> None:
        """No step for ``params``: their gradients go (torch optimizers skip a parameter without one), and so do the
        tables' sparse ones: no row is touched."""
        for p in params:
            p.grad = None
            if p in self._sparse:
                self._sparse[p].drop_gradient()

    def register_sparse(self, param: Tensor, table: Any) -> None:
        """``param``'s gradient is held by ``table`` (``gradient_share``, ``scale_gradient``, ``drop_gradient``),
        one copy of it sharded over ``table.copy_group`` (``None``: on this rank alone; read at each norm, as a
        ``span="auto"`` table may move at its first lookup): counted in :meth:`grad_norm`, scaled by
        :meth:`clip`, dropped by :meth:`skip`."""
        self._sparse[param] = table

    def sparse_tables(self) -> list[Any]:
        """The tables registered by :meth:`register_sparse` (for memory estimates)."""
        return list(self._sparse.values())

    def unregister_sparse(self) -> None:
        self._sparse = {}

    # ------------------------------------------------------------------ registration (precision policies)

    def register_master(self, param: Tensor, master: Tensor) -> None:
        self._compensation.pop(param, None)
        self.rebind(master, self.hold(param, "master", master.data))
        self._masters[param] = master
        self._param_of[master] = param

    def take_registrations(self, other: "TrainingState") -> None:
        """Take over ``other``'s masters and compensations (the same tensors): a precision plugin that meets a new
        strategy keeps the true weights of its earlier fit."""
        self._masters.update(other._masters)
        self._compensation.update(other._compensation)
        self._param_of.update(other._param_of)

    def register_compensation(self, param: Tensor, compensation: Tensor) -> None:
        self._masters.pop(param, None)
        self._compensation[param] = self.hold(param, "compensation", compensation)

    # ------------------------------------------------------------------ parameter storage

    def rebind(self, param: Tensor, storage: Tensor) -> None:
        """Make ``storage`` the data of ``param`` (a module parameter or a master) in place of its own: the object
        stays, so optimizers, hooks, ``state_dict`` keys and tied weights (one Parameter reached twice) follow. The
        one place that changes a parameter's storage: a shared-memory view (node_state/), a store file's view
        (store/), a bf16 copy (precision/). After DDP wraps the module, a new dtype drops the parameter's allreduce.
        A parameter on the meta device (declared, not built: store/materialize.py) swaps its tensor for one on
        ``storage`` (``param.data =`` refuses another device type); the object stays as well."""
        if param.is_meta and not storage.is_meta:
            swap_in(param, storage)
            return
        param.data = storage

    def to_dtype(self, params: Iterable[Tensor], dtype: torch.dtype) -> None:
        """Store every floating-point tensor of ``params`` in ``dtype`` (the others, and those already in it, stay)."""
        for p in params:
            if p.is_floating_point() and p.dtype != dtype:
                self.rebind(p, p.data.to(dtype))

    def own_memory(self, params: Iterable[Tensor]) -> None:
        """Give every tensor of ``params`` a private copy of its values (out of a shared or mapped file it viewed)."""
        for p in params:
            self.rebind(p, p.data.clone())

    # ------------------------------------------------------------------ where the tensors live (out-of-core store)

    def hold(self, param: Tensor, kind: str, tensor: Tensor) -> Tensor:
        """``tensor`` (``param``'s ``kind``: "master", "master_grad", "compensation") where training keeps it: the
        store's copy under out-of-core training, else ``tensor`` itself."""
        return tensor if self.store is None else self.store.hold(param, kind, tensor)

    def stream(self, params: Iterable[Tensor], dirty: bool = False,
               kinds: tuple[str, ...] = ("grad",)) -> Iterable[list[Tensor]]:
        """``params`` in order, in runs that are in memory together (one pass over memory, a foreach op, per run): all
        of them at once; under out-of-core training one layer's, its ``kinds`` brought in ahead and released behind
        (written back when the caller wrote to them: ``dirty``)."""
        if self.store is None:
            return [list(params)]
        return self.store.stream(params, self.parameter_of, dirty, kinds)

    def settle(self, optimizer: Any, params: Iterable[Tensor]) -> None:
        """After ``optimizer`` stepped ``params``: under out-of-core training their state moves into the store and
        their layers leave memory."""
        if self.store is not None:
            self.store.after_step(optimizer, params, self.parameter_of)

    def parameter_of(self, tensor: Tensor) -> Tensor:
        """The module parameter ``tensor`` stands for: a master's parameter (masters stand in for their parameters
        in the optimizer during its step), else ``tensor`` itself."""
        return self._param_of.get(tensor, tensor)

    def master(self, param: Tensor) -> Optional[Tensor]:
        return self._masters.get(param)

    def compensation(self, param: Tensor) -> Optional[Tensor]:
        return self._compensation.get(param)

    def extra_tensors(self) -> list[Tensor]:
        """Every tensor held besides the module's parameters (for memory accounting)."""
        return [*self._masters.values(), *self._compensation.values()]

    # ------------------------------------------------------------------ the true weights

    def where(self, param: Tensor) -> str:
        """``"module"``, ``"fp32 master"`` or ``"bf16 + compensation"``."""
        if param in self._masters:
            return MASTER
        return COMPENSATED if param in self._compensation else MODULE

    @torch.no_grad()
    def read(self, param: Tensor) -> Tensor:
        """The true value of ``param`` as a new tensor, in fp32 or wider: a float64 weight (``precision="64-true"``)
        stays float64, a bf16 one comes with its master or its compensation in fp32."""
        master = self._masters.get(param)
        truth = master if master is not None else param
        value = truth.detach().to(torch.promote_types(truth.dtype, torch.float32), copy=True)
        comp = self._compensation.get(param) if master is None else None
        return value.add_(comp) if comp is not None else value

    @torch.no_grad()
    def write(self, param: Tensor, value: Tensor) -> None:
        """Make ``value`` (any float dtype) the true value of ``param``: the module parameter gets it rounded to its
        dtype; a master takes it whole, a compensation takes what the rounding lost."""
        master = self._masters.get(param)
        if master is not None:
            master.copy_(value)
            param.copy_(master)
            return
        param.copy_(value)
        comp = self._compensation.get(param)
        if comp is not None:
            comp.copy_(value - param)  # in fp32 (type promotion), rounded once into the compensation

    @torch.no_grad()
    def read_flat(self, params: list[Tensor]) -> Tensor:
        """The true values of ``params`` in one new flat tensor, in fp32, or in float64 where a true weight is
        float64 (rounding float64 weights to fp32 would move them by ~1e-8)."""
        values = [self.read(p).reshape(-1) for p in params]
        dtype = functools.reduce(torch.promote_types, (v.dtype for v in values))
        return torch.cat([v.to(dtype) for v in values])

    @torch.no_grad()
    def write_flat(self, params: list[Tensor], flat: Tensor) -> None:
        """Make consecutive pieces of ``flat`` (as :meth:`read_flat` lays them out) the true values of ``params``."""
        offset = 0
        for p in params:
            self.write(p, flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()

    def average(self, params: Iterable[Tensor], allreduce_mean: Callable[[Tensor], None]) -> None:
        """Replace the true value of every parameter by its average: ``allreduce_mean`` averages one flat tensor in
        place across the ranks that take part (one call for all parameters), as :meth:`read_flat` reads them."""
        params = list(params)
        if not params:
            return
        flat = self.read_flat(params)
        allreduce_mean(flat)
        self.write_flat(params, flat)


__all__ = ["TrainingState", "MODULE", "MASTER", "COMPENSATED"]
