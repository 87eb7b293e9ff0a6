"""The one GPT of the project (recipes, benchmarks and tests): pre-norm blocks, one fused QKV projection, the
exact GELU (``GPTConfig(gelu="tanh")``: GPT-2's approximation), tied input/output embeddings,
``F.scaled_dot_product_attention`` or the attention written out (``GPTConfig(attention="manual")``: its T x T scores
are saved for backward, the large activations that graph sharding's tests and benchmark plan around; ``"blocked"``
skips the scores above the diagonal blocks).

Plain ``torch.nn``: nothing here knows about Lightning, so the same module trains under any strategy or precision
and the benchmarks compare like with like.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable


ATTENTIONS = ("auto", "sdpa", "manual", "blocked")
GELUS = ("tanh", "none")  # F.gelu's approximate=
#: "auto" takes the blocked path up to this many tokens in each dtype, sdpa beyond and in other dtypes
#: (see GPTConfig.attention)
BLOCKED_MAX_LEN = {torch.bfloat16: 1024, torch.float32: 512}
SCORE_BYTES = 8 << 20  # the largest scores tensor the written-out attention makes (see WrittenOutAttention)


@dataclass
class GPTConfig:
    """The model's shape. The named sizes in recipes/configs/ follow GPT-2/GPT-3 shapes (layers x width)."""

    vocab_size: int = 256
    """Tokens in the vocabulary (256 for the byte-level tokenizer)."""
    block_size: int = 256
    """Longest context, in tokens (positions are learned)."""
    n_layer: int = 6
    """Transformer blocks."""
    n_head: int = 6
    """Attention heads; must divide ``n_embd``."""
    n_embd: int = 384
    """Residual width."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches (0 for pretraining on enough data)."""
    bias: bool = True
    """Biases in the Linear and LayerNorm layers (GPT-2 has them; the recipe's ``GPTPretrain`` leaves them out by
    default, as PaLM and LLaMA do). Without them a step does less: no bias in the forward GEMMs, no reduction over
    the tokens for each bias gradient, fewer tensors for the optimizer. Measured on 2 Zen 4 cores (torch 2.13, the
    small config's GPT, forward, backward, clip and fused AdamW, the two models' steps alternating): bf16 0.96x the
    step time with biases (median of 30 pairs, quartiles 0.93-0.98), fp32 with oneDNN capped at AVX2 0.95x (16
    pairs); trained side by side on the same 400 batches, validation loss 2.142 without them, 2.162 with."""
    attention: str = "auto"
    """``"sdpa"`` (``F.scaled_dot_product_attention``: torch's fused flash kernel on CPU), ``"manual"`` (written out:
    every query against every key, masked; two matmuls and a softmax), ``"blocked"`` (written out, the queries in
    blocks of 128 rows up to 256 tokens and of 256 above, each against the keys up to its last row only: the scores
    above the diagonal blocks are never computed) or ``"auto"``: blocked up to 1,024 tokens in bf16 and up to 512 in
    fp32, sdpa otherwise. The written-out paths (``WrittenOutAttention``) keep their scores for backward (blocked: 3/4
    of the ``t x t`` matrix at 256 tokens, 5/8 at 1,024), the flash kernel none: at 8 x 1,024 tokens of the 125m
    shape one bf16 forward + backward peaked at 5.2 GiB against 3.7 (manual 5.9). Measured on 2 Zen 4 cores (torch
    2.13, the whole model's forward, backward, clip and AdamW step, the two models' steps alternating): blocked took
    0.78x the flash kernel's time at 8 x 512 tokens and 0.81x at 4 x 1,024 in bf16; in fp32 (oneDNN capped at
    AVX2) 0.975x at 16 x 256, 0.95x at 8 x 512 and 0.98x at 4 x 1,024, where its fp32 scores would cost twice
    bf16's memory for the 2%."""
    gelu: str = "none"
    """The MLP's GELU, as ``F.gelu(approximate=...)``: ``"none"`` (the exact erf form) or ``"tanh"`` (GPT-2's
    approximation). Measured on 2 Zen 4 cores (torch 2.13, the small config's GPT, forward + backward, CPU time,
    6 interleaved rounds): in bf16 the exact form took 0.95x the tanh form's time (2,017 vs 2,131 ms; the GELU alone
    0.44x), in fp32 0.96-0.98x; on 16 Xeon (Emerald Rapids) cores the bf16 GELU alone 0.75x at 4 threads."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig({name}={value!r}): allowed is an int >= 1")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig(n_embd={self.n_embd}, n_head={self.n_head}): n_head must divide n_embd"
            )
        if self.gelu not in GELUS:
            raise ValueError(f"GPTConfig(gelu={self.gelu!r}): allowed are {GELUS}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"GPTConfig(attention={self.attention!r}): allowed are {ATTENTIONS}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"GPTConfig(bias={self.bias!r}): allowed are True and False")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig(dropout={self.dropout!r}): allowed is a number in [0, 1)")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        # One (d, 3d) matmul instead of three (d, d): one larger GEMM keeps the CPU's vector units busier.
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head, self.dropout, self.attention = cfg.n_head, cfg.dropout, cfg.attention
        # added to the scores: 0 on and below the diagonal, -inf above (the written-out paths)
        self.register_buffer("causal", torch.full((cfg.block_size, cfg.block_size), float("-inf")).triu(1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x)
        p = self.dropout if self.training else 0.0
        kind = self.kind(t, qkv.dtype)
        if kind == "sdpa":
            # torch's fused CPU flash-attention kernel: no (t, t) score matrix is kept for backward
            q, k, v = qkv.view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p).transpose(1, 2).reshape(b, t, d)
        else:
            y = WrittenOutAttention.apply(qkv, self.n_head, self.causal, t if kind == "manual" else query_block(t), p)
        return self.proj(y)

    def kind(self, t: int, dtype: torch.dtype) -> str:
        """The attention path a sequence of ``t`` tokens takes in ``dtype``: "sdpa", "manual" or "blocked"."""
        if self.attention != "auto":
            return self.attention
        return "blocked" if t <= BLOCKED_MAX_LEN.get(dtype, 0) else "sdpa"


def query_block(t: int) -> int:
    """Query rows per block of the blocked attention at ``t`` tokens: 128 up to 256 tokens, 256 above (measured,
    see ``GPTConfig.attention``)."""
    return 128 if t <= 256 else 256


def _tiles(heads: int, t: int, rows: int, element_size: int) -> list[tuple[int, int, int, int]]:
    """The written-out attention's tiles ``(start, end, first head, end head)``: the queries in blocks of ``rows``
    (each against the keys up to its last row), the heads in groups whose scores take at most ``SCORE_BYTES``."""
    tiles = []
    for start in range(0, t, rows):
        end = min(start + rows, t)
        group = max(1, SCORE_BYTES // ((end - start) * end * element_size))
        tiles += [(start, end, g, min(g + group, heads)) for g in range(0, heads, group)]
    return tiles


def _bmm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b`` for batches of matrices. Into a row slice (not contiguous), a fresh product and a copy: torch's
    ``bmm`` writes a strided ``out=`` through a slower path (fp32, a block of 64 heads x 128 x 256 by 256 x 64 on 2 Zen
    4 cores: 2.24 ms against 1.81 + 0.13 for the copy)."""
    if out.is_contiguous():
        torch.bmm(a, b, out=out)
    else:
        out.copy_(torch.bmm(a, b))


class WrittenOutAttention(torch.autograd.Function):
    """Causal attention written out, from the fused projection's ``(batch, t, 3 * width)`` output to the
    ``(batch, t, width)`` input of the output projection, with a backward of its own.

    The queries go in blocks of ``rows``, each against the keys up to its last row only, so that the scores above
    the diagonal blocks are never computed (``rows = t``: the whole ``t x t`` matrix); the heads go in groups whose
    scores take at most ``SCORE_BYTES``: under glibc's default settings a larger tensor is a fresh mmap, faulted in
    page by page at every step (the whole model at 8 x 1024 tokens in bf16: 1.17-1.21x sdpa's step time in one
    group, 0.92x in groups). Mask + scale * q k^T in the GEMM itself (one ``baddbmm`` onto the additive mask).

    Why not autograd over the same ops: q, k and v come out of the projection in one relayout copy instead of three,
    and their gradients go back in one; the backward writes each block's gradients into place instead of autograd's
    zero-filled slice gradients, adds and concatenations. Saved for backward: q, k, v and each tile's probabilities
    (with dropout also the dropped ones), as autograd would. Measured on 2 Zen 4 cores (torch 2.13, 16 x 256 tokens,
    6 heads of 64, bf16): the 6 layers' attention forward + backward alone 0.83-0.85x the time of autograd over the
    same blocked ops; the whole model's step (forward, backward, clip, fused AdamW) 0.974x (median of 30 alternating
    pairs, quartiles 0.955-1.000), with the same loss to the last bit. Gradients of gradients are not supported (as
    with the sdpa kernel)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, n_head: int, causal: torch.Tensor, rows: int, p: float) -> torch.Tensor:
        b, t, width = qkv.shape
        hd = width // (3 * n_head)
        heads = qkv.new_empty(3, b, n_head, t, hd)
        heads.copy_(qkv.reshape(b, t, 3, n_head, hd).permute(2, 0, 3, 1, 4))
        heads = heads.view(3, b * n_head, t, hd)
        q, k, v = heads
        y = qkv.new_empty(b, n_head, t, hd)
        out = y.view(b * n_head, t, hd)
        saved = []
        for s, e, g, h in _tiles(b * n_head, t, rows, qkv.element_size()):
            probs = torch.baddbmm(causal[s:e, :e].to(qkv.dtype), q[g:h, s:e], k[g:h, :e].mT, alpha=hd**-0.5)
            probs = probs.softmax(-1)
            kept = F.dropout(probs, p) if p else probs
            _bmm_into(out[g:h, s:e], kept, v[g:h, :e])
            saved += [probs, kept] if p else [probs]
        ctx.save_for_backward(heads, *saved)
        ctx.rows, ctx.p = rows, p
        return y.transpose(1, 2).reshape(b, t, width // 3)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        heads, *saved = ctx.saved_tensors
        q, k, v = heads
        bh, t, hd = q.shape
        b, p = dy.shape[0], ctx.p
        dy = dy.reshape(b, t, bh // b, hd).transpose(1, 2).reshape(bh, t, hd)
        grads = torch.empty_like(heads)
        dq, dk, dv = grads
        tiles = list(enumerate(_tiles(bh, t, ctx.rows, q.element_size())))
        per_tile = 2 if p else 1
        for i, (s, e, g, h) in reversed(tiles):  # the last block's tiles first: they write every key's gradient
            probs, kept = saved[i * per_tile], saved[i * per_tile + per_tile - 1]
            dkept = torch.bmm(dy[g:h, s:e], v[g:h, :e].mT)
            if p:
                dkept.masked_fill_(kept == 0, 0).mul_(1 / (1 - p))
            ds = torch._softmax_backward_data(dkept, probs, -1, probs.dtype)
            _bmm_into(dq[g:h, s:e], ds, k[g:h, :e])
            if e == t:
                torch.bmm(kept.mT, dy[g:h, s:e], out=dv[g:h])
                torch.bmm(ds.mT, q[g:h, s:e], out=dk[g:h])
            else:
                dv[g:h, :e] += torch.bmm(kept.mT, dy[g:h, s:e])
                dk[g:h, :e] += torch.bmm(ds.mT, q[g:h, s:e])
        grads[:2].mul_(hd**-0.5)
        n_head = bh // b
        return grads.view(3, b, n_head, t, hd).permute(1, 3, 0, 2, 4).reshape(b, t, 3 * n_head * hd), None, None, \
            None, None


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.gelu = cfg.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.gelu))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        # Pre-norm: the residual stream is never normalized, which keeps deep stacks trainable without warm-up tricks.
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied: one matrix reads and writes tokens
        self.apply(self._init)
        # GPT-2: scale the residual projections by 1/sqrt(2 * layers) so the stream's variance does not grow
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, time, vocab)`` for token ids ``(batch, time)``."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"GPT.forward: sequence length {t} exceeds block_size={self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters (the tied matrix counted once); without the position embedding by default, as GPT-2 counts."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n


class GPTWithLoss(GPT):
    """The GPT with its next-token loss as ``training_step(batch, batch_idx)``, ``batch = (inputs, targets)``.

    The step a LightningModule would have, for loops that call it without Lightning: graph sharding profiles a
    model's ``training_step``, and the sharding benchmark and tests run it by hand. Module and parameter names are
    the GPT's (``blocks.0.attn.qkv``, ...). The softmax runs in fp32 whatever the matmuls, as in pretrain_gpt.py.
    """

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        return F.cross_entropy(self(idx).float().flatten(0, 1), targets.flatten())


def train_flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Matmul FLOPs per trained token (forward + backward = 3x forward), attention included, as in PaLM's appendix B.

    The closed form the MFU figures are checked against; the monitors use Lightning's ``measure_flops`` instead.
    """
    n = 12 * cfg.n_layer * cfg.n_embd**2 + cfg.vocab_size * cfg.n_embd  # weight matmuls, head included
    attn = 2 * cfg.n_layer * seq_len * cfg.n_embd  # QK^T and AV, causal half not subtracted (as the counter)
    return 6 * n + 6 * attn
