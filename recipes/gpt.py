"""The one GPT of the project (recipes, benchmarks and tests): pre-norm blocks, one fused QKV projection, the
exact GELU (``GPTConfig(gelu="tanh")``: GPT-2's approximation), tied input/output embeddings,
``F.scaled_dot_product_attention`` or the attention written out (``GPTConfig(attention="manual")``: its T x T scores
are saved for backward, the large activations that graph sharding's tests and benchmark plan around).

Plain ``torch.nn``: nothing here knows about Lightning, so the same module trains under any strategy or precision
and the benchmarks compare like with like.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


ATTENTIONS = ("auto", "sdpa", "manual")
GELUS = ("tanh", "none")  # F.gelu's approximate=
MANUAL_MAX_LEN = 256  # "auto" uses the manual path in bf16 up to this many tokens (see GPTConfig.attention)


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
    """Biases in the Linear and LayerNorm layers."""
    attention: str = "auto"
    """``"sdpa"`` (``F.scaled_dot_product_attention``: torch's fused flash kernel on CPU), ``"manual"`` (two bf16
    matmuls and a softmax) or ``"auto"``: manual for bf16 compute with sequences of up to 256 tokens, sdpa otherwise.
    Measured on 2 Zen 5 cores (torch 2.13, forward + backward, 64-dim heads): in bf16 the flash kernel took 1.8-3x
    the manual path's time up to 256 tokens (36.9 vs 20.9 ms at 16 x 6 heads x 256) and won from 512 on (281 vs
    674 ms at 8 x 12 x 1024); in fp32 the flash kernel was as fast or faster at every length."""
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
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig(dropout={self.dropout!r}): allowed is a number in [0, 1)")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        # One (d, 3d) matmul instead of three (d, d): one larger GEMM keeps the CPU's vector units busier.
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head, self.dropout, self.attention = cfg.n_head, cfg.dropout, cfg.attention
        # added to the scores: 0 on and below the diagonal, -inf above (the manual path)
        self.register_buffer("causal", torch.full((cfg.block_size, cfg.block_size), float("-inf")).triu(1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        if self._manual(t, q.dtype):
            # mask + scale * q k^T in the GEMM itself (one baddbmm): no separate passes over the (t, t) scores to
            # scale and mask them (this attention's forward + backward in bf16: 0.62-0.77x the time)
            h = b * self.n_head
            att = torch.baddbmm(self.causal[:t, :t].to(q.dtype), q.reshape(h, t, -1), k.reshape(h, t, -1).mT,
                                alpha=q.shape[-1] ** -0.5)
            y = F.dropout(att.softmax(-1), p, self.training).view(b, self.n_head, t, t) @ v
        else:
            # torch's fused CPU flash-attention kernel: no (t, t) score matrix is kept for backward
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def _manual(self, t: int, dtype: torch.dtype) -> bool:
        if self.attention != "auto":
            return self.attention == "manual"
        return dtype == torch.bfloat16 and t <= MANUAL_MAX_LEN


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
