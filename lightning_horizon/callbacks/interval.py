"""The monitors' step intervals: an int, or None for the Trainer's ``log_every_n_steps`` (as Lightning's own
callbacks and ``self.log`` follow it)."""

from __future__ import annotations

from typing import Any

from lightning_horizon.checks import is_int, require


def check_interval(owner: str, name: str, value: Any, minimum: int) -> None:
    """Raise ValueError unless ``value`` is None or an int (not a bool) >= ``minimum``."""
    never = " (0: never)" if minimum == 0 else ""
    require(value is None or is_int(value, minimum), owner, name, value,
            f"an int >= {minimum}{never} or None (the Trainer's log_every_n_steps)")


__all__ = ["check_interval"]
