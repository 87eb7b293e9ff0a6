"""Save a small checkpoint, then start saving a large one to the same path: the parent kills us mid-save.

``python save_then_die.py PATH [background]``: with ``background``, the writes run on AtomicCheckpointIO's thread."""

import sys

import torch

from lightning_horizon.checkpoint_io import AtomicCheckpointIO

path = sys.argv[1]
io = AtomicCheckpointIO(background=sys.argv[2:] == ["background"])
io.save_checkpoint({"version": "old", "w": torch.arange(10.0)}, path)
if io.background:
    io.wait()
print("SAVED_OLD", flush=True)
# 2 GiB of fp32 in 32 storages of their own. Their values do not matter, only that the save takes a while: memory
# never written reads as zeros and costs neither randn's CPU time (4 s here) nor 2 GiB of resident memory.
big = {"version": "new", "w": [torch.empty(64 * 1024 * 1024 // 4) for _ in range(32)]}
io.save_checkpoint(big, path)
if io.background:
    io.wait()
print("SAVED_NEW", flush=True)
