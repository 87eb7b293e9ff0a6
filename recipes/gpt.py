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

import torch
import torch.nn.functional as F
from torch import nn


ATTENTIONS = ("auto", "sdpa", "manual", "blocked")
GELUS = ("tanh", "none")  # F.gelu's approximate=
BLOCKED_MAX_LEN = 1024  # "auto" uses the blocked path in bf16 up to this many tokens (see GPTConfig.attention)
SCORE_BYTES = 8 << 20  # the largest scores tensor the written-out attention makes (see _written_out)


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
    above the diagonal blocks are never computed) or ``"auto"``: blocked for bf16 compute up to 1,024 tokens, sdpa
    otherwise. The written-out paths keep their scores for backward (blocked: 3/4 of the ``t x t`` matrix at 256
    tokens, 5/8 at 1,024), the flash kernel none: at 8 x 1,024 tokens of the 125m shape one bf16 forward + backward
    peaked at 5.2 GiB against 3.7 (manual 5.9). Measured on 2 Zen 4 cores (torch 2.13, the whole model's
    forward, backward and AdamW step in bf16, interleaved rounds): blocked took 0.98-1.00x the manual path's time at
    16 x 256 tokens, where the flash kernel took 1.15x; 0.82-0.84x the flash kernel's at 8 x 512 and 0.92-0.96x at
    2 x 1,024 and 8 x 1,024. In fp32 the flash kernel was as fast or faster (blocked 1.01-1.02x at 256 tokens;
    forward + backward of the attention alone 1.2x at 1,024)."""
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
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        kind = self.kind(t, q.dtype)
        if kind == "sdpa":
            # torch's fused CPU flash-attention kernel: no (t, t) score matrix is kept for backward
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:
            rows = t if kind == "manual" else query_block(t)
            heads = (z.reshape(b * self.n_head, t, -1) for z in (q, k, v))
            y = _written_out(*heads, self.causal, rows, p, self.training).view(b, self.n_head, t, -1)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def kind(self, t: int, dtype: torch.dtype) -> str:
        """The attention path a sequence of ``t`` tokens takes in ``dtype``: "sdpa", "manual" or "blocked"."""
        if self.attention != "auto":
            return self.attention
        return "blocked" if dtype == torch.bfloat16 and t <= BLOCKED_MAX_LEN else "sdpa"


def query_block(t: int) -> int:
    """Query rows per block of the blocked attention at ``t`` tokens: 128 up to 256 tokens, 256 above (measured,
    see ``GPTConfig.attention``)."""
    return 128 if t <= 256 else 256


def _written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: torch.Tensor, rows: int, p: float,
                 training: bool) -> torch.Tensor:
    """Causal attention of ``(heads, t, head_dim)`` tensors, written out: the queries in blocks of ``rows``, each
    against the keys up to its last row only, so that the scores above the diagonal blocks are never computed
    (``rows = t``: the whole ``t x t`` matrix). Mask + scale * q k^T in the GEMM itself (one ``baddbmm`` onto the
    additive mask): no separate passes over the scores to scale and mask them. The heads go in groups whose scores
    take at most ``SCORE_BYTES``: under glibc's default settings a larger tensor is a fresh mmap, faulted in page by
    page at every step (the whole model at 8 x 1024 tokens in bf16: 1.17-1.21x sdpa's step time in one group,
    0.92x in groups)."""
    h, t, _ = q.shape
    scale = q.shape[-1] ** -0.5
    ys = []
    for start in range(0, t, rows):
        end = min(start + rows, t)
        mask = causal[start:end, :end].to(q.dtype)
        group = max(1, SCORE_BYTES // ((end - start) * end * q.element_size()))
        parts = [
            F.dropout(torch.baddbmm(mask, q[g : g + group, start:end], k[g : g + group, :end].mT, alpha=scale)
                      .softmax(-1), p, training) @ v[g : g + group, :end]
            for g in range(0, h, group)
        ]
        ys.append(torch.cat(parts) if len(parts) > 1 else parts[0])
    return torch.cat(ys, 1) if len(ys) > 1 else ys[0]


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
