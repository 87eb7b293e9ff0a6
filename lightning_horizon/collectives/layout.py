"""The bucket layout gradients are reduced in, carried through a checkpoint so that a restart reduces the same bytes.

DDP reduces its first iteration in one bucket holding every parameter, then rebuilds its buckets in the order the
gradients became ready. A resumed run builds a fresh DDP, so its first step is one bucket again where the
uninterrupted run had the rebuilt ones. Mostly an element's sum does not depend on the bucket around it, but
int8 shares a scale among a block of neighbours, and gloo's ring over more than two ranks adds an element's
terms in an order set by where it falls in the buffer. So the first step after a restart differed from the
uninterrupted run in the last bits, and training amplified it (int8: losses 2e-5 apart; bf16 weights up to
4e-2 apart after ten more steps, tests/test_reliability.py).

``BucketLayout`` records the layout DDP's hook calls show (parameter names per bucket, in bucket order), the
layout goes into the checkpoint, and a resumed run cuts any bucket that is a union of saved buckets into those,
each reduced exactly as the uninterrupted run reduced it. Once the fresh DDP has rebuilt its own buckets (the
same ones: same model, same gradient order), every bucket matches and nothing is cut.

A checkpoint written after the very first optimizer step comes before DDP has used its rebuilt buckets: the
strategy then has DDP rebuild them early (the rebuild DDP runs at the next forward anyway) and the layout is read
from the gradient-ready order of that first step and the rebuilt bucket sizes (:meth:`BucketLayout.derive`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)


class Piece:
    """The parts of DDP's ``GradBucket`` that the reduction reads: a flat ``buffer`` and the parameters'
    gradients as views into it, each at the buffer offset ``moves`` gives it.

    One saved bucket cut out of a DDP bucket (:meth:`BucketLayout.pieces`), or, built by :meth:`contiguous`, a
    stand-in for a GradBucket where there is no DDP (benchmarks, tests).
    """

    def __init__(self, index: int, last: bool, params: list[torch.Tensor], moves: list[tuple[int, int, int]],
                 buffer: torch.Tensor) -> None:
        """``moves``: per parameter ``(offset in the source bucket, offset in buffer, numel)``."""
        self._index, self._last, self._params, self._moves = index, last, params, moves
        self._buffer = buffer
        self._grads = [self._buffer[dst : dst + n].view_as(p) for p, (_, dst, n) in zip(params, moves)]

    @classmethod
    def contiguous(cls, params: list[torch.Tensor], buffer: Optional[torch.Tensor] = None, last: bool = True,
                   index: int = 0) -> "Piece":
        """A bucket of ``params`` laid out one after another in ``buffer`` (default: fp32 zeros)."""
        moves, offset = [], 0
        for p in params:
            moves.append((offset, offset, p.numel()))
            offset += p.numel()
        return cls(index, last, list(params), moves,
                   torch.zeros(offset, dtype=torch.float32) if buffer is None else buffer)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def load(self, source: torch.Tensor) -> None:
        """Copy this piece's gradients out of the DDP bucket's buffer."""
        for src, dst, n in self._moves:
            self._buffer[dst : dst + n].copy_(source[src : src + n])

    def store(self, target: torch.Tensor) -> None:
        """Copy the reduced gradients back into the DDP bucket's buffer."""
        for src, dst, n in self._moves:
            target[src : src + n].copy_(self._buffer[dst : dst + n])


def offsets(bucket: Any) -> list[int]:
    """Each gradient's offset in the bucket's buffer, in elements."""
    base, size = bucket.buffer().data_ptr(), bucket.buffer().element_size()
    return [(g.data_ptr() - base) // size for g in bucket.gradients()]


class BucketLayout:
    """The layout seen in the last complete backward, and the layout a restored run reduces in."""

    def __init__(self, named_parameters: list[tuple[str, torch.Tensor]]) -> None:
        self._names = {id(p): name for name, p in named_parameters}
        self._params = dict(named_parameters)
        #: parameter names per bucket, in bucket order, as the hook saw them in the last complete backward
        self.seen: list[list[str]] = []
        self._current: list[list[str]] = []
        self._target: list[list[str]] = []
        self._bucket_of: dict[str, int] = {}
        self._warned = False
        #: complete backward passes recorded
        self.backwards = 0
        #: DDP buckets reduced as several saved ones (a restart's first step)
        self.cuts = 0

    def names(self, bucket: Any) -> list[str]:
        return [self._names[id(p)] for p in bucket.parameters()]

    def record(self, names: list[str], last: bool) -> None:
        """One bucket as reduced (DDP calls the hook in bucket order; the last bucket closes the backward)."""
        self._current.append(names)
        if last:
            self.seen, self._current = self._current, []
            self.backwards += 1

    def pieces(self, bucket: Any, names: list[str]) -> Optional[list[Piece]]:
        """The saved buckets that make up this DDP bucket, or ``None`` when it is one of them (or not cut-able)."""
        if not self._target:
            return None
        indices = sorted({self._bucket_of.get(n, -1) for n in names})
        if len(indices) == 1 and indices[0] >= 0 and self._target[indices[0]] == names:
            return None
        cover = [n for i in indices if i >= 0 for n in self._target[i]]
        if -1 in indices or sorted(cover) != sorted(names):
            if not self._warned:
                self._warned = True
                log.warning("collectives: a gradient bucket straddles the checkpoint's buckets; it is reduced as"
                            " DDP laid it out (the step may differ from an uninterrupted run in the last bits)")
            return None
        src = dict(zip(names, offsets(bucket)))
        out = []
        for i in indices:
            params = [self._params[n] for n in self._target[i]]
            moves, dst = [], 0
            for n, p in zip(self._target[i], params):
                moves.append((src[n], dst, p.numel()))
                dst += p.numel()
            buffer = torch.empty(dst, dtype=bucket.buffer().dtype)
            out.append(Piece(i, bucket.is_last() and i == indices[-1], params, moves, buffer))
        self.cuts += 1
        return out

    def derive(self, ready_order: list[str], sizes: list[int]) -> bool:
        """Set ``seen`` from DDP's rebuilt bucket sizes (elements, bucket order) and the gradient-ready order it
        rebuilt them from: consecutive runs of that order. False (nothing set) when they do not line up."""
        numel = {n: self._params[n].numel() for n in ready_order}
        layout, i = [], 0
        for size in sizes:
            names, total = [], 0
            while total < size and i < len(ready_order):
                names.append(ready_order[i])
                total += numel[ready_order[i]]
                i += 1
            if total != size:
                return False
            layout.append(names)
        if i != len(ready_order):
            return False
        self.seen = layout
        return True

    @property
    def restored(self) -> bool:
        return bool(self._target)

    def state_dict(self) -> list[list[str]]:
        return [list(b) for b in (self.seen or self._target)]

    def load_state_dict(self, layout: list[list[str]]) -> None:
        known = [[n for n in b if n in self._params] for b in layout]
        if any(len(k) != len(b) for k, b in zip(known, layout)):
            log.warning("collectives: the checkpoint's bucket layout names parameters this model does not have;"
                        " reducing in DDP's own layout")
            return
        self._target = known
        self._bucket_of = {n: i for i, b in enumerate(known) for n in b}
