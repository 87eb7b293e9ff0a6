"""A rehearsal: a run of ``training_step`` that must leave no trace (graph sharding's profile runs the first step's
forward once more, then puts every tensor and attribute it wrote back).

Code whose forward changes state beyond what that undoing reaches asks :func:`active` and keeps still: a table on
disk moves rows into its cache and records where in bookkeeping the profile does not restore.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

_depth = 0


@contextmanager
def rehearsing() -> Iterator[None]:
    """Mark the block as a rehearsal (nests)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def active() -> bool:
    """Whether a rehearsal runs now."""
    return _depth > 0


__all__ = ["active", "rehearsing"]
