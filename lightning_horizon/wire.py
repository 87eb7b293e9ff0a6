"""Tensors travel as raw bytes in object collectives.

torch's object collectives (``gather_object``, ``all_gather_object``, ...) pickle what they send, and pickling a
tensor pickles its storage through ``torch.save`` (``TypedStorage.__reduce__``): a rank that sends tensors calls
``torch.save``. Code written for Lightning's ``ddp`` expects ``torch.save`` on rank 0 only while a checkpoint is
written (a callback that counts or patches it would see every rank). :func:`pack` turns each tensor of an object
into a :class:`Record` of what pickle keeps: its whole storage's raw bytes, dtype, storage offset, shape, stride,
``requires_grad``, Parameter or not. :func:`unpack` makes them tensors again as unpickling would: on the same
device, each on a new storage of its own, one tensor met twice one tensor again (a checkpoint that holds them is
byte for byte the one pickle gave). Containers (dicts and their subclasses, lists, tuples, named tuples) that hold
a tensor are rebuilt with their own types; everything else, and tensors pickle treats specially (subclasses,
sparse, quantized, lazily conjugated or negated, meta, non-leaf with grad, with hooks or attributes), is left to pickle.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, NamedTuple

import torch
from torch import nn


class Record(NamedTuple):
    """A tensor as :func:`pack` sends it: its storage's bytes and the view of them pickle would rebuild."""

    data: bytes
    device: str
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool
    parameter: bool


def pack(obj: Any) -> Any:
    """``obj`` with every plain tensor in it (at any depth of dicts, lists and tuples) a :class:`Record`."""

    def record(t: torch.Tensor) -> Record:
        data = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage().cpu()).numpy().tobytes()
        return Record(data, str(t.device), t.dtype, t.storage_offset(), tuple(t.shape), t.stride(), t.requires_grad,
                      type(t) is nn.Parameter)

    return _map(obj, lambda x: record(x) if _plain(x) else None)


def unpack(obj: Any) -> Any:
    """``obj`` with every :class:`Record` in it a tensor again, as :func:`pack` found it."""

    def tensor(r: Record) -> torch.Tensor:
        storage = torch.UntypedStorage.from_buffer(r.data, dtype=torch.uint8) if r.data else torch.UntypedStorage(0)
        storage = storage.to(device=r.device)
        t = torch.empty(0, dtype=r.dtype, device=r.device).set_(storage, r.offset, r.shape, r.stride)
        if r.parameter:
            return nn.Parameter(t, requires_grad=r.requires_grad)
        return t.requires_grad_(r.requires_grad)

    return _map(obj, lambda x: tensor(x) if isinstance(x, Record) else None)


def _plain(x: Any) -> bool:
    """A tensor whose pickled form is its storage and view alone (what :class:`Record` keeps)."""
    return (
        type(x) in (torch.Tensor, nn.Parameter)
        and x.layout == torch.strided
        and x.device.type != "meta"
        and not (x.is_quantized or x.is_conj() or x.is_neg() or x.is_nested)
        and (x.is_leaf or not x.requires_grad)
        and not getattr(x, "_backward_hooks", None)
        and not vars(x)  # Python attributes set on the tensor, which pickle keeps
    )


def _map(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` with ``leaf(x)`` in place of each ``x`` for which it is not ``None``; a container is copied only when
    something in it changed, and an object met twice is converted once (pickle keeps such sharing, and so do we)."""
    memo: dict[int, Any] = {}

    def walk(x: Any) -> Any:
        if id(x) in memo:
            return memo[id(x)]
        out = leaf(x)
        if out is not None:
            pass
        elif isinstance(x, dict):
            items = {k: walk(v) for k, v in x.items()}
            out = x
            if any(items[k] is not v for k, v in x.items()):
                out = copy.copy(x)
                out.update(items)
        elif isinstance(x, (list, tuple)):
            items = [walk(v) for v in x]
            out = x
            if any(a is not b for a, b in zip(items, x)):
                if isinstance(x, list):
                    out = copy.copy(x)
                    out[:] = items
                elif hasattr(x, "_fields"):  # a named tuple
                    out = type(x)(*items)
                else:
                    out = type(x)(items)
        else:
            out = x
        memo[id(x)] = out
        return out

    return walk(obj)


__all__ = ["Record", "pack", "unpack"]
