"""Argument checks: fail at construction, naming the owner, the parameter, the value and what is allowed.

Two predicates say whether a value is acceptable; the raising forms turn a failed one into the single message
format that every check in the package uses::

    HorizonStrategy(threads_per_rank=0): allowed is an int >= 1 or None (one per core)

``bool`` is a subclass of ``int`` in Python, so ``True`` would pass a bare ``isinstance(x, int)``: both predicates
refuse it, as a flag given where a count or a size belongs is a mistake.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, Optional


def is_int(value: Any, minimum: Optional[int] = None) -> bool:
    """Whether ``value`` is an ``int`` (not a ``bool``), and ``>= minimum`` when one is given."""
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def is_number(
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    include_low: bool = False,
    include_high: bool = False,
) -> bool:
    """Whether ``value`` is an ``int`` or a ``float`` (not a ``bool``, not NaN) inside the interval from ``low``
    to ``high``, each end open unless included. With the defaults: any finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # NaN != NaN
        return False
    above = value >= low if include_low else value > low
    below = value <= high if include_high else value < high
    return above and below


def require(ok: bool, owner: str, name: str, value: Any, allowed: str) -> None:
    """Raise ``ValueError("{owner}({name}={value!r}): allowed is {allowed}")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{owner}({name}={value!r}): allowed is {allowed}")


def check_int(owner: str, name: str, value: Any, minimum: int, note: str = "") -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) >= ``minimum``; ``note`` is appended to what is
    allowed, e.g. ``" (0: never)"``."""
    require(is_int(value, minimum), owner, name, value, f"an int >= {minimum}{note}")


def check_one_of(owner: str, name: str, value: Any, choices: Collection[Any]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices`` (compared with ``==``, as ``in`` does)."""
    require(value in choices, owner, name, value, f"one of {tuple(choices)!r}")


__all__ = ["check_int", "check_one_of", "is_int", "is_number", "require"]
