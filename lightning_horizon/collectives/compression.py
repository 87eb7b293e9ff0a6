"""Compressed allreduce (bf16, int8 with a scale per block) and its error feedback.

The allreduce is a reduce-scatter and an all-gather done by hand, so that nothing is ever *summed* in the
narrow type (gloo sums int8 in int8, which overflows, and bf16 in bf16, which loses the small addends):

1. each member encodes its tensor, cut in one chunk per member, and sends chunk ``j`` to member ``j``
   (all-to-all);
2. member ``j`` decodes the chunks it received and sums them in fp32, in member order;
3. it encodes the sum again and every member gathers every encoded sum (all-gather), then decodes.

Both encodings lose something, and both losses are fed back: a rank adds what its own encodings lost to its
next contribution (error feedback), so over the steps the applied updates add up to the true gradients minus
the residual still held. Since the residual only ever enters through a sum, it is kept per *parameter*, not per
bucket: DDP rebuilds its buckets after the first iteration and the residual follows the parameters.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from lightning_horizon.collectives.comm import Comm
from lightning_horizon.collectives.layout import offsets
from lightning_horizon.collectives.chunks import round_up
from lightning_horizon.collectives.native import int8_kernel


class Codec:
    """Encodes rows of fp32 values into bytes (``[rows, wire_bytes]`` uint8) and back.

    The codec runs on the cores that train. int8 runs as one C kernel (:mod:`.native`) where the machine has a C
    compiler: the encode and its error in one pass over memory, block by block in the L1 cache, and a chunk's rows
    decoded and summed in one; otherwise as torch ops, which give the same bytes in several passes (``native=False``
    asks for those; ``native=True`` fails where there is no kernel). Each torch step writes into a tensor it already
    has (glibc returns a freed tensor of megabytes to the system and faults the next one in page by page: an 8 MiB
    encode took 8 ms so, against 0.6 ms for its operations).
    """

    def __init__(self, name: str, int8_block: int = 256, native: Optional[bool] = None) -> None:
        self.name = name
        self.block = int8_block if name == "int8" else 1
        self._kernel = int8_kernel() if name == "int8" and native is not False else None
        if native and self._kernel is None:
            raise RuntimeError(f"Codec({name!r}, native=True): there is no C kernel for it here (int8 only, built with"
                               " the machine's C compiler; see lightning_horizon.collectives.native)")

    @property
    def native(self) -> bool:
        """Whether the C kernel codes (else torch ops)."""
        return self._kernel is not None

    def _wire(self, c: int) -> int:
        return c + 4 * (c // self.block)

    def encode(self, x: torch.Tensor, error: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
        """``x``: ``[rows, c]`` fp32, contiguous, ``c`` a multiple of the block. Returns ``[rows, bytes]`` uint8.

        With ``error`` (``[rows, c]`` fp32), also writes into it (or adds to it, with ``accumulate``) what the
        encoding lost: ``x - decode(encode(x))``."""
        rows, c = x.shape
        if self._kernel is not None:
            for t in (x, error):
                if t is not None:
                    _fp32_rows(t)
            packed = torch.empty(rows, self._wire(c), dtype=torch.uint8)
            self._kernel.horizon_int8_encode(x.data_ptr(), rows, c, self.block, packed.data_ptr(), packed.shape[1],
                                             None if error is None else error.data_ptr(), int(accumulate))
            return packed
        if self.name == "bf16":
            packed = x.to(torch.bfloat16).view(torch.uint8)
        else:
            blocks = x.view(rows, -1, self.block)
            q = blocks.abs()
            scale = q.amax(dim=-1, keepdim=True).div_(127.0)
            # A zero block keeps scale 1 (no 0/0); a non-finite block keeps its non-finite scale, so the decoded
            # block stays non-finite and an overflow still reaches the optimizer's skip logic.
            scale.masked_fill_(scale == 0, 1.0)
            # times the reciprocal, as the C kernel does (a divide per value was 18% of its encode)
            torch.mul(blocks, scale.reciprocal(), out=q).nan_to_num_().round_().clamp_(-127, 127)
            packed = torch.empty(rows, self._wire(c), dtype=torch.uint8)
            packed[:, :c].view(torch.int8).view(rows, -1, self.block).copy_(q)
            packed[:, c:].copy_(scale.view(rows, -1).view(torch.uint8))
        if error is not None:
            decoded = self.decode(packed, c)
            lost = torch.sub(x, decoded, out=decoded)  # written over the decoded values: no other tensor
            error.add_(lost) if accumulate else error.copy_(lost)
        return packed

    def decode(self, packed: torch.Tensor, c: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Inverse of :meth:`encode` for ``c`` values per row: ``[rows, c]`` fp32, into ``out`` if given."""
        rows = packed.shape[0]
        if self._kernel is not None:
            out = torch.empty(rows, c, dtype=torch.float32) if out is None else _fp32_rows(out).view(rows, c)
            self._kernel.horizon_int8_decode(packed.data_ptr(), rows, c, self.block, packed.shape[1], out.data_ptr(), 0)
            return out
        if self.name == "bf16":
            values = packed.view(torch.bfloat16)
            return values.float() if out is None else out.view(rows, c).copy_(values)
        # the scales' bytes copied out: where they sit is 4-byte aligned only for blocks that are multiples of 4
        scale = torch.empty(rows, c // self.block, 1, dtype=torch.float32)
        scale.view(rows, -1).view(torch.uint8).copy_(packed[:, c:])
        values = packed[:, :c].view(torch.int8)
        out = values.float() if out is None else out.view(rows, c).copy_(values)
        return out.view(rows, -1, self.block).mul_(scale).view(rows, c)

    def decode_sum(self, packed: torch.Tensor, c: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The sum of the decoded rows, in fp32 and in row order: ``[c]``, into ``out`` if given."""
        if self._kernel is not None:
            out = torch.empty(c, dtype=torch.float32) if out is None else _fp32_rows(out)
            self._kernel.horizon_int8_decode(packed.data_ptr(), packed.shape[0], c, self.block, packed.shape[1],
                                             out.data_ptr(), 1)
            return out
        return torch.sum(self.decode(packed, c), dim=0, out=out)


def _fp32_rows(t: torch.Tensor) -> torch.Tensor:
    """``t``, checked to be what the C kernel reads and writes: contiguous fp32 (it would read or write any other
    dtype's bytes as fp32, silently)."""
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(f"the int8 kernel codes contiguous fp32 rows, got {t.dtype} strides {t.stride()}")
    return t


def coded_elements(chunk: int, group: int) -> int:
    """Elements one rank encodes or decodes in :func:`compressed_allreduce` over ``group`` members with ``chunk``
    (padded) elements per member: the cost model's unit of codec time, and the probe's.

    It encodes its ``group * chunk`` elements and decodes them (their error), decodes what it receives and what it
    gathers (``group * chunk`` each), and encodes its ``chunk`` of the sum and decodes it (its error).
    """
    return 4 * group * chunk + 2 * chunk


class CompressedAllreduce:
    """One compressed allreduce in three phases, so that a pipeline can run the codec of one chunk while another
    chunk's bytes are on the wire: :meth:`__init__` encodes and starts the all-to-all, :meth:`exchange` waits for it,
    sums and re-encodes, and starts the all-gather; :meth:`finish` waits for that and decodes.

    Between phases the collectives run on gloo's threads and this thread is free. Every phase of every instance is
    called in an order that depends only on the tensor sizes, so every member issues the same collectives in the
    same order. Run back to back, the phases are :func:`compressed_allreduce`.
    """

    def __init__(self, x: torch.Tensor, comm: Comm, codec: Codec) -> None:
        """Encode ``x`` (1-D fp32, contiguous) and start sending chunk ``j`` of it to member ``j``.

        ``x`` is not read again after the encode, so its memory takes the sum (a fresh bucket-sized tensor per call
        costs its page faults): the caller's tensor is overwritten."""
        self.n, g = x.numel(), comm.size
        self.comm, self.codec = comm, codec
        self.c = c = round_up(self.n, g * codec.block) // g
        self._padded = padded = x if g * c == self.n else F.pad(x, (0, g * c - self.n))
        # what this rank's encodings lost, in fp32 whatever the default dtype (64-true makes it float64)
        self.error = torch.empty(g * c, dtype=torch.float32)
        # alive until the all-to-all that sends it is waited for
        self._packed = codec.encode(padded.view(g, c), error=self.error.view(g, c))
        self._received = torch.empty_like(self._packed)
        self._work = comm.all_to_all(self._received, self._packed, async_op=True)

    def exchange(self) -> None:
        """Sum the received chunks in fp32 (member order: the same sum on every member), encode this member's sum
        and start gathering every member's."""
        if self._work is not None:
            self._work.wait()
        c, comm, codec = self.c, self.comm, self.codec
        total = codec.decode_sum(self._received, c, out=self._padded[:c])
        # The re-encoding's loss belongs to the sum: fed back by this rank alone, it re-enters the next sum once.
        mine_error = self.error[comm.index * c : (comm.index + 1) * c].view(1, c)
        self._packed = mine = codec.encode(total.view(1, c), error=mine_error, accumulate=True)
        self._received = torch.empty((comm.size, mine.shape[1]), dtype=torch.uint8)
        self._work = comm.all_gather(self._received, mine, async_op=True)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's sum of ``x``, and what this rank's encodings lost (same length as ``x``)."""
        if self._work is not None:
            self._work.wait()
        # A non-finite entry of ``error`` comes with a non-finite sum: the hook then keeps the previous residual.
        total = self.codec.decode(self._received, self.c, out=self._padded)
        return total.view(-1)[: self.n], self.error[: self.n]


def compressed_allreduce(x: torch.Tensor, comm: Comm, codec: Codec) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's sum of ``x`` (1-D fp32, overwritten: the sum may be returned in its memory), and what this
    rank's encodings lost (same length as ``x``)."""
    op = CompressedAllreduce(x, comm, codec)
    op.exchange()
    return op.finish()


class ErrorFeedback:
    """Per-parameter residuals of the compression, added into a bucket and stored back from it (bucket layout)."""

    def __init__(self, named_parameters: list[tuple[str, torch.Tensor]]) -> None:
        self._names = {id(p): name for name, p in named_parameters}
        self._shapes = {name: p.shape for name, p in named_parameters}
        #: residual per parameter name, fp32, in units of the *sum* over ranks (not the average)
        self.residual: dict[str, torch.Tensor] = {}

    def _layout(self, bucket) -> list[tuple[str, int, int]]:
        """``(name, offset in the bucket's buffer, numel)`` per parameter of the bucket."""
        return [(self._names[id(p)], offset, p.numel()) for p, offset in zip(bucket.parameters(), offsets(bucket))]

    def add_to(self, bucket, x: torch.Tensor) -> None:
        """Add the residual of the bucket's parameters to ``x`` (the bucket's values, bucket layout), in place: no
        bucket-sized tensor (a fresh one per step costs its page faults)."""
        for name, offset, numel in self._layout(bucket):
            held = self.residual.get(name)
            if held is not None:
                x[offset : offset + numel].add_(held.view(-1))

    def scatter(self, bucket, error: Union[torch.Tensor, list[tuple[int, torch.Tensor]], None]) -> None:
        """Store ``error`` as the new residual of the bucket's parameters, into the tensors already held where there
        are: a tensor in bucket layout, or the ``(offset, values)`` pieces of it that are not zero (a two-level
        reduction's error lies in this rank's slices only, and a bucket-sized tensor of zeros around them would be
        faulted in fresh at every step); ``None``: all zero."""
        pieces = [(0, error)] if isinstance(error, torch.Tensor) else error
        for name, offset, numel in self._layout(bucket):
            if pieces is None:
                self.residual.pop(name, None)
                continue
            held = self.residual.get(name)
            if held is None:
                held = self.residual[name] = torch.zeros(self._shapes[name], dtype=torch.float32)
            else:
                held.zero_()
            flat = held.view(-1)
            for start, values in pieces:
                lo, hi = max(start, offset), min(start + values.numel(), offset + numel)
                if lo < hi:
                    flat[lo - offset : hi - offset].copy_(values[lo - start : hi - start])

    def scale(self, params: list[torch.Tensor], factor: float) -> None:
        """Multiply the residuals of ``params`` by ``factor`` (their step's gradients were scaled by it)."""
        for p in params:
            name = self._names.get(id(p))
            if name in self.residual:
                self.residual[name].mul_(factor)

    def state_dict(self) -> dict:
        return {"residual": {k: v.clone() for k, v in self.residual.items()}}

    def load_state_dict(self, state: dict) -> None:
        residual = state.get("residual", {})
        unknown = sorted(set(residual) - set(self._shapes))
        if unknown:
            raise ValueError(f"error feedback state names parameters this model does not have: {unknown[:5]}")
        for name, value in residual.items():
            if tuple(value.shape) != tuple(self._shapes[name]):
                raise ValueError(f"error feedback residual {name!r}: shape {tuple(value.shape)}, parameter has"
                                 f" {tuple(self._shapes[name])}")
        self.residual = {k: v.detach().float().clone() for k, v in residual.items()}
