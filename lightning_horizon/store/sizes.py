"""The out-of-core store's files: the kind of each (a layer's weights, gradients, masters, compensations, each
optimizer state tensor), the bytes each takes on disk, and how a set of them splits between the reading threads."""

from __future__ import annotations

import torch

from lightning_horizon.store.files import PAGE, MappedFile, align
from lightning_horizon.store.units import Unit

WEIGHT, GRAD = "weight", "grad"


def state_kind(key: str, dtype: torch.dtype) -> str:
    """The kind of the store's file for the per-element optimizer state ``key`` in ``dtype``."""
    return f"state.{key}.{str(dtype).removeprefix('torch.')}"


def file_bytes(unit: Unit, dtype: torch.dtype) -> int:
    """The disk bytes of ``unit``'s file of one kind in ``dtype``: every parameter's tensor 64-byte aligned, whole
    pages."""
    return align(max(sum(-(-p.numel() * dtype.itemsize // 64) * 64 for p in unit.params), 1))


def split(files: list[MappedFile], n: int) -> list[list[tuple[MappedFile, int, int]]]:
    """``files``' bytes in at most ``n`` contiguous shares of about equal size (whole pages), each a list of
    (file, start, end) ranges."""
    share = -(-sum(align(f.used) for f in files) // max(n, 1) // PAGE) * PAGE
    parts: list[list[tuple[MappedFile, int, int]]] = [[]]
    room = share
    for f in files:
        start = 0
        while start < f.used:
            if room == 0:
                parts.append([])
                room = share
            end = min(align(f.used), start + room)
            parts[-1].append((f, start, min(end, f.used)))
            room -= end - start
            start = end
    return [p for p in parts if p]



def pending(units: list[Unit], existing: set[tuple[int, str]],
            state_kinds: dict[int, set[tuple[str, torch.dtype]]]) -> tuple[int, int]:
    """Disk bytes of the files that the first backward and step will create and that do not exist yet (``existing``:
    (unit index, kind) of those that do): one for each unit's gradients, and one for each kind of per-element
    optimizer state a parameter of the unit will have (``state_kinds``: by parameter id, (state key, dtype) pairs,
    as store/reserve.py learns them). Returns (gradients, optimizer state)."""
    grads = state = 0
    for u in units:
        if not u.params:
            continue
        if (u.index, GRAD) not in existing:  # gradients in the parameters' dtype (the widest of the unit)
            grads += file_bytes(u, max((p.dtype for p in u.params), key=lambda d: d.itemsize))
        kinds = {state_kind(k, d): d for p in u.params for k, d in state_kinds.get(id(p), ())}
        state += sum(file_bytes(u, d) for kind, d in kinds.items() if (u.index, kind) not in existing)
    return grads, state


__all__ = ["GRAD", "WEIGHT", "file_bytes", "pending", "split", "state_kind"]
