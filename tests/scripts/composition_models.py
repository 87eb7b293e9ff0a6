"""The models of the composition matrix (tests/test_composition.py), all tiny: a few thousand parameters at most, so
that emulated bf16 (20-100x slower than fp32 on a CPU without native bf16) still runs a step in milliseconds.

Every model is a LightningModule built from :class:`Checked`, which holds what the matrix varies around the model:
the optimization (automatic, manual with two optimizers, gradient accumulation), the injected faults of the
GradNormBackoff cases (a NaN loss on one rank, a loss spike on another) and the checks of what reaches user code
(no FakeTensor or meta tensor outside the sharding profile's own fake mode).

Kinds: ``gpt`` (recipes/gpt.py, dropout, tied embeddings), ``transformer`` (Lightning's demo encoder-decoder
Transformer on random tokens; it builds its positional table lazily in ``forward`` and keeps it as an attribute),
``boring`` (Lightning's BoringModel itself), ``batchnorm`` (BatchNorm1d running statistics), ``tied`` (an
embedding tied to the output head and two tied hidden layers) and ``generator`` (noise drawn from the module's own
``torch.Generator``, saved with the checkpoint as a user would). Every model but BoringModel has a block that
activation recompute may replay, with a LayerNorm in it (a norm meeting the weights' dtype in a recompute).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.demos.transformer import Transformer
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.data import Dataset, TensorDataset

from recipes.gpt import GPT, GPTConfig

KINDS = ("gpt", "transformer", "boring", "batchnorm", "tied", "generator")
VOCAB, SEQ, FEATURES, CLASSES = 32, 8, 8, 4
BATCH = 4  # per rank and micro-batch
SPIKE = 1e5  # the injected spike multiplies the loss (and so the gradient norm) by this


# ---------------------------------------------------------------------------------------------- fake/meta checks


def fake_mode_active() -> bool:
    """Whether a FakeTensorMode is active here (the sharding profile's fake pass): fake inputs are expected then."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def bad_tensors(obj: Any, where: str, depth: int = 0) -> list[str]:
    """Paths of FakeTensors and meta tensors inside ``obj`` (tensors, lists, tuples, dicts, nested)."""
    out: list[str] = []
    if depth > 6:
        return out
    if isinstance(obj, torch.Tensor):
        if isinstance(obj, FakeTensor):
            out.append(f"{where}: FakeTensor {tuple(obj.shape)}")
        elif obj.is_meta:
            out.append(f"{where}: meta tensor {tuple(obj.shape)}")
        grad = obj.grad if isinstance(obj, nn.Parameter) else None
        if grad is not None:
            out += bad_tensors(grad, f"{where}.grad", depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            out += bad_tensors(x, f"{where}[{i}]", depth + 1)
    elif isinstance(obj, dict):
        for k, x in obj.items():
            out += bad_tensors(x, f"{where}[{k!r}]", depth + 1)
    return out


def module_bad_tensors(module: nn.Module, where: str) -> list[str]:
    """Fake or meta parameters, gradients, buffers, and tensors kept as plain attributes of any submodule."""
    out: list[str] = []
    for name, mod in module.named_modules():
        prefix = f"{where}.{name}" if name else where
        for k, p in mod._parameters.items():
            out += bad_tensors(p, f"{prefix}.{k}")
        for k, b in mod._buffers.items():
            out += bad_tensors(b, f"{prefix}.{k}")
        for k, v in vars(mod).items():
            if not k.startswith("_") and isinstance(v, (torch.Tensor, list, tuple, dict)):
                out += bad_tensors(v, f"{prefix}.{k}")
    return out


# ---------------------------------------------------------------------------------------------- the common module


class Checked:
    """Mixin before ``L.LightningModule`` (or BoringModel): optimization, fault injection, input checks.

    ``inject``: ``{"nan": [step, rank], "spike": [step, rank]}`` (training steps, 0-based) or ``None``.
    """

    def setup_checked(self, optimization: str, inject: dict | None) -> None:
        self.optimization = optimization
        # "manual-twice": one optimizer, two synchronized backward passes (the second at half weight) before its step
        self.automatic_optimization = optimization not in ("manual", "manual-twice")
        self.inject = inject or {}
        self.violations: list[str] = []
        self.losses: list[float] = []

    # ------------------------------------------------------------------ steps

    @property
    def n_optimizers(self) -> int:
        return 2 if self.optimization == "manual" else 1

    def training_index(self) -> int:
        """The 0-based training step (manual: every optimizer's step counts in Lightning's global_step)."""
        return self.trainer.global_step // self.n_optimizers

    def training_step(self, batch: Any, batch_idx: int):
        if not fake_mode_active():
            self.violations += bad_tensors(batch, f"training_step(batch) step {self.trainer.global_step}")
            self.violations += module_bad_tensors(self, f"module at training_step {self.trainer.global_step}")
        loss = self.compute_loss(batch).float()
        step, rank = self.training_index(), self.global_rank
        if self.inject.get("nan") == [step, rank]:
            loss = loss * float("nan")
        if self.inject.get("spike") == [step, rank]:
            loss = loss * SPIKE
        if self.automatic_optimization:
            return loss
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        if self.optimization == "manual-twice":
            self.manual_backward(0.5 * self.compute_loss(batch).float())
        for opt in opts:
            opt.step()
        return loss.detach()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # here, not in training_step: the sharding profile runs training_step once more
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.violations += bad_tensors(outputs, f"on_train_batch_end(outputs) step {self.trainer.global_step}")
        if isinstance(loss, torch.Tensor) and not isinstance(loss, FakeTensor) and not loss.is_meta:
            self.losses.append(float(loss.detach()))

    def param_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        params = list(self.parameters())  # tied parameters once
        half = max(1, len(params) // 2)
        return params[:half], params[half:]

    def configure_optimizers(self):
        # SGD: an update proportional to the gradient, so that a precision's error on the gradients shows in the
        # weights at its own size (AdamW turns a gradient that is rounding noise into a full-size step of random
        # sign); the manual case's second optimizer is AdamW, for optimizer state with two moments.
        if self.optimization == "manual":
            a, b = self.param_groups()
            return [torch.optim.SGD(a, lr=0.1, momentum=0.9), torch.optim.AdamW(b, lr=1e-2, weight_decay=0.01)]
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        if getattr(self, "scheduler", False):  # LambdaLR: recomputes lr from base_lrs at every step
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8**s)}
        return opt


# ---------------------------------------------------------------------------------------------- the kinds


class GPTModule(Checked, L.LightningModule):
    def __init__(self, optimization: str, inject: dict | None) -> None:
        super().__init__()
        self.setup_checked(optimization, inject)
        self.net = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16, dropout=0.1))

    def compute_loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.net(x).flatten(0, 1).float(), y.flatten())


class TransformerModule(Checked, L.LightningModule):
    def __init__(self, optimization: str, inject: dict | None) -> None:
        super().__init__()
        self.setup_checked(optimization, inject)
        self.net = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.1)

    def compute_loss(self, batch):
        x, y = batch
        return F.nll_loss(self.net(x, y).float(), y.reshape(-1))


class Boring(Checked, BoringModel):
    """Lightning's BoringModel: one Linear(32, 2), an MSE loss towards ones; its batch is a bare tensor."""

    def __init__(self, optimization: str, inject: dict | None) -> None:
        super().__init__()
        self.setup_checked(optimization, inject)

    def compute_loss(self, batch):
        return self.step(batch)  # BoringModel's own; training_step and configure_optimizers are Checked's (MRO)


class BatchNormModule(Checked, L.LightningModule):
    def __init__(self, optimization: str, inject: dict | None) -> None:
        super().__init__()
        self.setup_checked(optimization, inject)
        # may be recomputed (BatchNorm may not: its running statistics would be updated twice)
        mlp = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 32), nn.GELU())
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.BatchNorm1d(32), nn.ReLU(), mlp, nn.BatchNorm1d(32),
                                 nn.Linear(32, CLASSES))

    def compute_loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)


class TiedBlock(nn.Module):
    """A LayerNorm, then two Linear layers sharing one matrix, with dropout between them."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.b.weight = self.a.weight
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.a(self.norm(x))))
        return h + torch.tanh(self.b(h))


class TiedModule(Checked, L.LightningModule):
    def __init__(self, optimization: str, inject: dict | None) -> None:
        super().__init__()
        self.setup_checked(optimization, inject)
        self.emb = nn.Embedding(VOCAB, 16)
        self.body = nn.Sequential(TiedBlock(16), TiedBlock(16))
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied input/output embedding

    def compute_loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.head(self.body(self.emb(x))).flatten(0, 1).float(), y.flatten())


class NoisyLayer(nn.Module):
    """Linear + GELU + multiplicative noise drawn from the layer's own generator (not torch's global one)."""

    def __init__(self, d_in: int, d_out: int, seed: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.lin(x))
        if not self.training:
            return h
        noise = torch.rand(h.shape, generator=self.generator, dtype=torch.float32, device=h.device)
        return h * (0.75 + 0.5 * noise).to(h.dtype)


class GeneratorModule(Checked, L.LightningModule):
    def __init__(self, optimization: str, inject: dict | None) -> None:
        super().__init__()
        self.setup_checked(optimization, inject)
        self.l1, self.l2 = NoisyLayer(FEATURES, 32, seed=101), NoisyLayer(32, 32, seed=202)
        # no generator of its own: may be recomputed
        self.mid = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 32))
        self.out = nn.Linear(32, CLASSES)

    def compute_loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.out(self.l2(self.mid(self.l1(x)))).float(), y)

    # the user's own generators are the user's to checkpoint (Lightning saves torch's global RNG nowhere either)
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["noise_generators"] = [self.l1.generator.get_state(), self.l2.generator.get_state()]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        for layer, state in zip((self.l1, self.l2), checkpoint["noise_generators"]):
            layer.generator.set_state(state)


MODULES = {"gpt": GPTModule, "transformer": TransformerModule, "boring": Boring, "batchnorm": BatchNormModule,
           "tied": TiedModule, "generator": GeneratorModule}


def build(kind: str, optimization: str, inject: dict | None = None) -> L.LightningModule:
    return MODULES[kind](optimization, inject)


def dataset(kind: str, n: int, seed: int = 1234) -> Dataset:
    """``n`` samples for ``kind``, the same on every rank (the sampler splits them)."""
    g = torch.Generator().manual_seed(seed)
    if kind in ("gpt", "transformer", "tied"):
        x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        y = (x * 5 + torch.arange(SEQ)) % VOCAB  # learnable: the loss falls
        return TensorDataset(x, y)
    if kind == "boring":
        torch_state = torch.get_rng_state()
        torch.manual_seed(seed)
        data = RandomDataset(32, n)  # Lightning's own: draws from the global generator
        torch.set_rng_state(torch_state)
        return data
    x = torch.randn(n, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)
    return TensorDataset(x, y)


__all__ = ["BATCH", "KINDS", "SPIKE", "bad_tensors", "build", "dataset", "fake_mode_active", "module_bad_tensors"]
