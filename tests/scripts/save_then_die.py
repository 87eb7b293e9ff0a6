"""Save a small checkpoint, then start saving a large one to the same path: the parent kills us mid-save."""

import sys

import torch

from lightning_horizon.checkpoint_io import AtomicCheckpointIO

path = sys.argv[1]
io = AtomicCheckpointIO()
io.save_checkpoint({"version": "old", "w": torch.arange(10.0)}, path)
print("SAVED_OLD", flush=True)
big = {"version": "new", "w": [torch.randn(64 * 1024 * 1024 // 4) for _ in range(32)]}  # 2 GiB of fp32
io.save_checkpoint(big, path)
print("SAVED_NEW", flush=True)
