"""Per-rank random-number-generator state, saved with the checkpoint and restored when training restarts.

Lightning checkpoints do not hold the RNG states, so a resumed run shuffles the next epoch (RandomSampler
draws its seed from torch's global generator), drops out and samples differently from the uninterrupted run.
HorizonStrategy keeps these states per rank under its checkpoint key and puts them back at the end of its
``setup``: the next draw is then the training data iterator's (Lightning's sanity check runs under
``isolate_rng``), exactly as in the uninterrupted run after the checkpoint was written.

The states are stored as tensors and plain Python values only, so ``torch.load(weights_only=True)`` accepts them.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
import torch

from lightning_horizon.parts import Part


class RNGState(Part):
    """A part of HorizonStrategy: ``state_dict`` captures the generators; a loaded state waits for ``apply``."""

    def __init__(self) -> None:
        self._pending: Optional[dict[str, Any]] = None

    def state_dict(self) -> dict[str, Any]:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        return {
            "torch": torch.get_rng_state(),
            "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
            "python": random.getstate(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = state

    def after_setup(self) -> None:
        """Restore a loaded state (once)."""
        state, self._pending = self._pending, None
        if state is None:
            return
        torch.set_rng_state(state["torch"])
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
