"""Fits of models declared on the meta device (tests/test_out_of_core.py), in-process and as a script.

``Declared(kind, where)``: a LightningModule holding the recipe GPT (``kind="gpt"``) or a tiny Hugging Face Llama
from a config (``kind="llama"``, random init, no download), built in ``__init__`` (``where="init"``: under
``trainer.init_module(empty_init=...)`` or plainly) or in ``configure_model`` (``where="configure"``).
``declared_fit`` trains it and returns the weights at the start of training, after it and the losses.

``python out_of_core_meta.py too_big STORE_DIR NBYTES``: a fit with a store of a model whose ``__init__`` built
``NBYTES`` of weights (``torch.empty``: untouched pages), run by the test inside a memory cgroup whose limit is
smaller: setup must refuse it with one line, before anything is copied.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from lightning_horizon import HorizonStrategy  # noqa: E402
from lightning_horizon.store import StoreConfig  # noqa: E402
from recipes.gpt import GPT, GPTConfig  # noqa: E402

VOCAB, SEQ = 32, 16


def make_net(kind: str) -> nn.Module:
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=3, n_head=2, n_embd=32))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))


class Declared(L.LightningModule):
    def __init__(self, kind: str, where: str = "init") -> None:
        super().__init__()
        self.kind = kind
        self.net: Optional[nn.Module] = make_net(kind) if where == "init" else None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = make_net(self.kind)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        logits = self.net(x) if self.kind == "gpt" else self.net(input_ids=x).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        self.losses.append(float(loss.detach()))
        return loss

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(1)
        return torch.utils.data.DataLoader(torch.randint(0, VOCAB, (24, SEQ + 1), generator=g), batch_size=4,
                                           shuffle=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class AtStart(L.Callback):
    """The weights, whether they are the store's, and the generator state when training starts."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        store = trainer.strategy.store
        self.weights = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        self.in_store = store is not None and all(store.store.knows(p) for p in pl_module.parameters() if p.requires_grad)
        self.materialized = store is not None and store.store.materialized
        self.rng = torch.get_rng_state()


def declared_fit(tmp: Path, kind: str, where: str, store: bool, steps: int = 3, ckpt: Optional[str] = None,
                 save: Optional[str] = None, every: Optional[int] = None, **store_kw: Any) -> dict[str, Any]:
    """One fit (32-true, one thread); with ``store`` the model is declared on the meta device (``init_module
    (empty_init=True)`` or ``configure_model``), without it built in RAM as its ``__init__`` builds it. ``every``:
    a checkpoint every that many steps, in ``tmp/ckpt``; ``save``: one after fit."""
    L.seed_everything(7, verbose=False)
    start = AtStart()
    config = StoreConfig(path=str(tmp / "store"), probe_bytes=0, **store_kw) if store else None
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HorizonStrategy(state_store=config, threads_per_rank=1),
                        max_steps=steps, logger=False, enable_checkpointing=every is not None,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp),
                        callbacks=[start] + ([L.pytorch.callbacks.ModelCheckpoint(
                            dirpath=str(tmp / "ckpt"), every_n_train_steps=every, save_top_k=-1,
                            filename="{step}")] if every else []))
    if where == "init" and store:
        with trainer.init_module(empty_init=True):
            model = Declared(kind, where)
    else:
        model = Declared(kind, where)
    declared = model.net is None or any(p.is_meta for p in model.parameters())
    trainer.fit(model, ckpt_path=ckpt)
    if save:
        trainer.save_checkpoint(save)
    return {"start": start.weights, "in_store": start.in_store, "materialized": start.materialized,
            "declared_on_meta": declared, "rng": start.rng, "losses": model.losses, "model": model,
            "end": {n: p.detach().clone() for n, p in model.named_parameters()}}


class TooBig(L.LightningModule):
    """Built whole by its ``__init__``: ``nbytes`` of fp32 weights in 4 layers (``torch.empty``: not touched)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1, 1) for _ in range(4))
        for layer in self.layers:
            layer.big = nn.Parameter(torch.empty(nbytes // 16))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return sum(layer(batch).sum() for layer in self.layers)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.randn(4, 1), batch_size=2)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def too_big(store_dir: str, nbytes: int, **strategy_kw: Any) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=store_dir,
                        strategy=HorizonStrategy(state_store=StoreConfig(path=store_dir, probe_bytes=0),
                                                 **strategy_kw))
    trainer.fit(TooBig(nbytes))


if __name__ == "__main__":
    if sys.argv[1] == "too_big":
        too_big(sys.argv[2], int(sys.argv[3]))
