"""The layers the out-of-core store streams: which parameters travel together, and which stay resident.

A unit is one child of the model's largest ``nn.ModuleList`` / ``nn.Sequential`` of parameter-holding children (a
transformer's blocks, by bytes): its forward runs as one piece, its weights are needed together, and the next one
is known. Every other trainable parameter (embeddings, the final norm, a head, a parameter tied between two units)
forms the resident unit: its weights stay mapped through the step; its gradients, masters and optimizer state are
still stored and streamed by the optimizer step like every unit's. A model without such a container has the
resident unit only (the step still streams its state).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from torch import Tensor, nn


@dataclass
class Unit:
    index: int
    name: str  # the module's path, "" for the resident unit
    module: Optional[nn.Module]  # None for the resident unit
    params: list[Tensor] = field(default_factory=list)

    @property
    def streamed(self) -> bool:
        return self.module is not None

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


def _trainable(module: nn.Module) -> list[Tensor]:
    return [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in _trainable(module))


def plan_units(root: nn.Module) -> list[Unit]:
    """Units in the order of the container (forward order for a stack of blocks), the resident unit last."""
    children = _largest_stack(root)
    names = [n for n, _ in children]
    # a parameter used by a module outside the units (tied to an embedding, say), or by two units, stays resident
    outside = {id(p) for name, m in root.named_modules()
               if not any(name == n or name.startswith(f"{n}.") for n in names) for p in m.parameters(recurse=False)}
    counts = Counter(id(p) for _, c in children for p in _trainable(c))
    units: list[Unit] = []
    for name, c in children:
        params = [p for p in _trainable(c) if counts[id(p)] == 1 and id(p) not in outside]
        if params:
            units.append(Unit(len(units), name, c, params))
    streamed = {id(p) for u in units for p in u.params}
    units.append(Unit(len(units), "", None, [p for p in _trainable(root) if id(p) not in streamed]))
    return units


def _largest_stack(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The parameter-holding children (path, module) of the container holding the most parameter bytes."""
    best: tuple[int, list[tuple[str, nn.Module]]] = (0, [])
    for name, m in root.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and m is not root:
            held = [(f"{name}.{n}", c) for n, c in m.named_children() if _param_bytes(c) > 0]
            size = sum(_param_bytes(c) for _, c in held)
            if len(held) >= 2 and size > best[0]:
                best = (size, held)
    return best[1]


__all__ = ["Unit", "plan_units"]
