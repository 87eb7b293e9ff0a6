"""The monitors' argument check: fail at construction, naming the parameter, the value and what is allowed."""

from __future__ import annotations


def check_int(owner: str, name: str, value: object, low: int, note: str = "") -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) >= ``low``; ``note`` is appended to the message."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner}({name}={value!r}): allowed is an int >= {low}{note}")
