"""Hugging Face's GPT-2 in place of the recipe's GPT: a language model written outside this project, trained the
recipe's way, so that a benchmark or a test can tell our defaults' effect from our own model code's.

    python recipes/bench_vs_lightning.py --model hf-gpt2 --arms lightning-32,lightning-bf16,horizon

``GPT2Pretrain`` is ``pretrain_gpt.GPTPretrain`` (optimizer, schedule, loss, validation, FLOP count) with
``transformers.GPT2LMHeadModel`` as its model, randomly initialized at the same shapes (``n_layer``, ``n_head``,
``n_embd``, ``block_size``, the byte vocabulary): pre-norm blocks, a fused QKV projection, a 4x MLP with GELU
(GPT-2's tanh form by default here) and tied embeddings, as recipes/gpt.py, so the FLOP count of the recipe's GPT
of those shapes is this one's too. It needs ``pip install transformers`` (in the ``dev`` extra); no weights or
tokenizer are downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from pretrain_gpt import GPTPretrain


class GPT2Pretrain(GPTPretrain):
    """GPTPretrain with ``transformers.GPT2LMHeadModel`` as the model (same arguments; ``attention`` chooses the
    recipe's own GPT's kernel, so it must stay at its default here: transformers' GPT-2 chooses its own). ``gelu``
    defaults to GPT-2's own tanh approximation (transformers' ``"gelu_new"``); ``"none"`` is its exact ``"gelu"``.
    ``bias`` stays ``True``: GPT-2's layers always have biases."""

    def __init__(self, gelu: str = "tanh", bias: bool = True, **kwargs: Any) -> None:
        super().__init__(gelu=gelu, bias=bias, **kwargs)
        if self.cfg.attention != "auto":
            raise ValueError(f"GPT2Pretrain(attention={self.cfg.attention!r}): transformers' GPT-2 chooses its own"
                             " attention kernel; allowed is 'auto'")
        if not self.cfg.bias:
            raise ValueError("GPT2Pretrain(bias=False): transformers' GPT-2 always has biases; allowed is True")
        from transformers import GPT2Config, GPT2LMHeadModel

        c = self.cfg
        self.model = GPT2LMHeadModel(GPT2Config(
            vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
            resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, bos_token_id=None, eos_token_id=None,
            activation_function={"tanh": "gelu_new", "none": "gelu"}[c.gelu],
        ))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits


__all__ = ["GPT2Pretrain"]
