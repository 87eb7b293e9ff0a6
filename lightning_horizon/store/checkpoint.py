"""Checkpoints of a model that does not fit in memory: written, resumed and read for inference without building it.

- **Save** (:class:`StreamedCheckpointIO`, what ``HorizonStrategy(state_store=...)`` uses in place of
  ``AtomicCheckpointIO``): the weights and optimizer state in a checkpoint are the store's views, so ``torch.save``
  reads them from the store's files through the page cache (clean pages, dropped first under pressure), one file
  after another; the checkpoint file is written as ``AtomicCheckpointIO`` writes it (a temporary file in the same
  folder, fsync, rename: a kill mid-save leaves the previous checkpoint intact), and every ``WRITE_BACK`` bytes the
  written part goes to the disk and leaves the page cache, so the save's dirty pages stay bounded under a memory
  limit (a memory cgroup counts them, and reclaim cannot write them out for it).
- **Resume**: the checkpoint is memory-mapped (``AtomicCheckpointIO.load_checkpoint``); the weights are copied into
  the store unit by unit (each unit, loaded, is written back and leaves memory: a post-hook on each unit's module),
  the optimizer state likewise (store.py ``after_step``). A model declared on the meta device is loaded after setup
  built it in the store (``HorizonStrategy.restore_checkpoint_after_setup``).
- **Inference afterwards**: :func:`load_weights` gives a model declared on the meta device the checkpoint's tensors
  themselves (``load_state_dict(assign=True)`` of the memory-mapped file: nothing copied, pages read on use), its
  buffers rebuilt from its declaration; :func:`to_safetensors` converts a checkpoint's weights into one safetensors
  file, tensor by tensor (``python -m lightning_horizon.store.checkpoint CKPT OUT.safetensors``), for
  ``StoreConfig(pretrained=...)``, Hugging Face's ``from_pretrained`` (with ``--prefix model.`` for a model held as
  ``self.model``) or any safetensors reader.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
from typing import Any, BinaryIO, Optional, Union

import torch
from torch import nn
from typing_extensions import override

from lightning_horizon.checkpoint_io import AtomicCheckpointIO, _is_local, atomic_file

#: bytes a save writes before it sends them to the disk and drops them from the page cache
WRITE_BACK = 64 << 20


class _WriteBack:
    """A binary file whose written bytes go to the disk and leave the page cache every ``every`` bytes."""

    def __init__(self, f: BinaryIO, every: int = WRITE_BACK) -> None:
        self.f, self.every, self.pending = f, every, 0

    def write(self, data: Any) -> int:
        n = self.f.write(data)
        self.pending += n
        if self.pending >= self.every:
            self.sync()
        return n

    def sync(self) -> None:
        self.f.flush()
        fd = self.f.fileno()
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self.pending = 0

    def flush(self) -> None:
        self.f.flush()


class StreamedCheckpointIO(AtomicCheckpointIO):
    """``AtomicCheckpointIO`` whose writes go to the disk as they are made (the page cache holds at most
    ``WRITE_BACK`` bytes of the file): for checkpoints larger than memory."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        with atomic_file(path) as f:
            out = _WriteBack(f)
            torch.save(checkpoint, out)
            out.sync()


def _weights(checkpoint: Union[str, os.PathLike, dict], prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint's ``state_dict`` (memory-mapped from the file), the names without ``prefix``."""
    if not isinstance(checkpoint, dict):
        checkpoint = torch.load(os.fspath(checkpoint), map_location="cpu", mmap=True, weights_only=False)
    sd = checkpoint.get("state_dict", checkpoint)
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


@torch.no_grad()
def load_weights(module: nn.Module, checkpoint: Union[str, os.PathLike, dict], prefix: str = "",
                 strict: bool = True) -> nn.Module:
    """``module`` (declared on the meta device: ``with lightning_horizon.store.deferred_init(): model = GPT(cfg)``)
    with the weights of a Lightning checkpoint: its tensors are the memory-mapped file's (nothing is copied; pages
    are read on use and dropped first under pressure), its buffers rebuilt from its declaration. ``prefix``: what
    comes before the module's names in the checkpoint (``"model."`` for a LightningModule's ``self.model``)."""
    from lightning_horizon.store.materialize import is_meta, materialize

    module.load_state_dict(_weights(checkpoint, prefix), strict=strict, assign=True)
    if is_meta(module):  # buffers (a causal mask, rotary frequencies): replayed from the declaration
        materialize(module, {}, lambda key: None, lambda unit: None, params=False)
    return module


_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def to_safetensors(checkpoint: Union[str, os.PathLike, dict], out: Union[str, os.PathLike], prefix: str = "") -> int:
    """Write the checkpoint's weights (names without ``prefix``) to the safetensors file ``out``, one tensor at a
    time from the memory-mapped checkpoint (atomic, written back as it goes). Returns the tensors written."""
    sd = _weights(checkpoint, prefix)
    header: dict[str, Any] = {}
    offset = 0
    for name, t in sd.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with atomic_file(out) as f:
        w = _WriteBack(f)
        w.write(struct.pack("<Q", len(head)))
        w.write(head)
        for t in sd.values():
            w.write(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy()))
        w.sync()
    return len(sd)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description="A Lightning checkpoint's weights as one safetensors file, streamed")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--prefix", default="", help="left out of the names (e.g. 'model.' for a LightningModule's"
                                               " self.model)")
    a = p.parse_args(argv)
    print(f"{to_safetensors(a.checkpoint, a.out, a.prefix)} tensors -> {a.out}")


if __name__ == "__main__":
    main()


__all__ = ["StreamedCheckpointIO", "WRITE_BACK", "load_weights", "to_safetensors"]
