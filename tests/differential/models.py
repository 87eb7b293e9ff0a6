"""What an example trains (tests/scripts/differential_fit.py builds it): a LightningModule with the drawn habits
around a tiny network, its data, its optimizers and schedule. Hooks that change when a store may step (clipping in
``configure_gradient_clipping``) are only defined on the class when the example draws them."""

from __future__ import annotations

import tempfile
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer
from lightning.pytorch.demos.boring_classes import RandomDataset
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch.utils.data import Dataset, TensorDataset

from lightning_horizon.embedding import ShardedEmbeddingBag, SparseSGD
from tests.differential.space import SECOND_OPTIMIZERS

VOCAB, SEQ, D, BATCH = 16, 4, 8, 4  # batch: per rank and micro-batch
#: the table on disk: one row per pair of tokens, its seed, the rows each rank keeps in memory (a step looks up at
#: most 2 micro-batches x 4 sequences x 3 pairs)
BAG_PAIRS, BAG_SEED, BAG_CACHE = VOCAB * VOCAB, 11, 32
#: calls of dynamo's compiled graphs in this process (model flag "compile"), by :func:`counting_backend`
COMPILED_CALLS = [0]


def _counted(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
    def run(*args: Any) -> Any:
        COMPILED_CALLS[0] += 1
        return graph(*args)

    return run


#: A torch.compile backend as inductor's front half: AOT autograd (forward and backward graphs, what activation
#: checkpointing and random ops inside a compiled region go through) whose graphs run eagerly (no inductor code:
#: the ops a reference computes, at float64's precision) and count their calls: a fit whose model dynamo gave up
#: on (run eagerly for good) counts none.
counting_backend = aot_autograd(fw_compiler=_counted, bw_compiler=_counted)


class UserAdam(torch.optim.Adam):
    """A user's subclass of Adam (counts its steps; the update is Adam's)."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.steps_taken = 0

    def step(self, closure: Any = None) -> Any:
        self.steps_taken += 1
        return super().step(closure)


class Block(nn.Module):
    def __init__(self, bn: bool, dropout: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D) if bn else None
        self.drop = nn.Dropout(0.1) if dropout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BatchNorm after the nonlinearity: right after the Linear it would remove every per-feature shift, so the
        # gradients of fc.bias and norm.bias would be 0 up to rounding, and an optimizer that normalizes the step
        # (Adam's family) would turn that noise into weight changes that follow the reduction order (plain DDP:
        # 6.8e-5 relative between 512 B and 25 MB buckets after 4 Adamax steps on 4 ranks), not the library
        h = torch.tanh(self.fc(self.norm(x)))
        if self.bn is not None:
            h = self.bn(h.flatten(0, 1)).view_as(h)
        return x + (self.drop(h) if self.drop is not None else h)


class Zoo(nn.Module):
    """Tokens -> embedding -> a stack of blocks (a store's units, recompute's candidates) -> head."""

    def __init__(self, m: dict, dtype: torch.dtype = torch.float32) -> None:
        """``dtype``: the fit's (a seeded table draws its rows in it when first used: its twin starts from them)."""
        super().__init__()
        # first: the module's first parameter, in the first optimizer (manual optimization splits them in two)
        # on disk: a table of the token pairs (more rows than a step touches), seeded, a cache smaller than a rank's
        # rows, so that rows are evicted between steps; "ddp"'s dense twin starts from the same rows and draws from
        # the global generator what an unseeded table would, so the layers after it start alike too
        self.pairs = bool(m.get("bag_disk"))
        rows = BAG_PAIRS if self.pairs else VOCAB
        if m["bag"] == "dense":
            self.bag = nn.EmbeddingBag(rows, D, mode="sum")
            if self.pairs:
                seeded = ShardedEmbeddingBag(rows, D, init_seed=BAG_SEED, dtype=dtype)
                self.bag.weight = nn.Parameter(seeded.state_dict()["weight"])
        elif m["bag"]:
            span = m["bag"] if m["bag"] in ("node", "auto") else "world"
            disk = {"init_seed": BAG_SEED, "rows_on_disk": tempfile.gettempdir(), "cache_rows": BAG_CACHE} \
                if self.pairs else {}
            self.bag = ShardedEmbeddingBag(rows, D, mode="sum", optimizer=SparseSGD(lr=None), span=span, **disk)
            if self.pairs:
                torch.empty(rows, D).normal_()  # what the dense twin's init draws
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(m["batchnorm"], m["dropout"]) for _ in range(2)])
        self.head = nn.Linear(D, VOCAB, bias=False)
        if m["tied"]:
            self.head.weight = self.emb.weight  # tied input/output embedding
            self.blocks[1].fc.weight = self.blocks[0].fc.weight  # and two hidden layers
        if m.get("bag_weights") and hasattr(self, "bag"):
            self.gain = nn.Parameter(torch.linspace(0.5, 1.5, rows))  # a learned weight per bag id

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if hasattr(self, "bag"):
            ids = x[:, :-1] * VOCAB + x[:, 1:] if self.pairs else x
            weights = self.gain[ids] if hasattr(self, "gain") else None
            h = h + self.bag(ids, per_sample_weights=weights).unsqueeze(1)  # the sequence's bag, at every position
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class Subject(L.LightningModule):
    """The drawn LightningModule. ``ex``: the example (tests/differential/space.py)."""

    def __init__(self, ex: dict, perturb: bool = False) -> None:
        super().__init__()
        self.ex, self.m, self.perturb = ex, ex["model"], perturb
        self.automatic_optimization = ex["optimization"] == "automatic"
        kind = self.m["kind"]
        if kind == "zoo":
            self.net = Zoo(self.m, torch.float64 if ex["precision"] == "64-true" else torch.float32)
        elif kind == "transformer":
            self.net = Transformer(vocab_size=VOCAB, ninp=D, nhead=2, nhid=16, nlayers=1,
                                   dropout=0.1 if self.m["dropout"] else 0.0)
        else:
            self.net = nn.Linear(32, 2)  # BoringModel's layer, trained on its RandomDataset towards ones (its loss)
        if self.m["never"]:
            self.spare = nn.Linear(2, 2)  # a parameter that never gets a gradient
        if self.m["sometimes"]:
            self.side = nn.Linear(2, 1)  # gets a gradient in every other micro-batch only
        if self.m["frozen"]:
            next(self.net.parameters()).requires_grad_(False)
        if self.m.get("compile"):  # in place: the state dict's keys stay the module's own
            for module in (self.net.blocks if kind == "zoo" else [self.net]):
                module.compile(backend=counting_backend)
        self.losses: list = []  # per micro-batch, on this rank
        self.val_losses: list = []
        self.eval_out: list = []

    # -------------------------------------------------------------- the step

    def loss(self, batch: Any, batch_idx: int) -> torch.Tensor:
        kind = self.m["kind"]
        if kind == "zoo":
            x, y = batch
            loss = F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())
        elif kind == "transformer":
            x, y = batch
            loss = F.nll_loss(self.net(x, y), y.reshape(-1))
        else:
            out = self.net(batch)
            loss = F.mse_loss(out, torch.ones_like(out))
        if self.m["sometimes"] and self.training and (self.trainer.global_step + batch_idx) % 2 == 0:
            ones = torch.ones(2, dtype=self.side.weight.dtype)
            loss = loss + 0.1 * self.side(ones).square().sum()
        return loss

    def training_step(self, batch: Any, batch_idx: int):
        if self.ex["skip_batch"] == batch_idx:
            return None  # a batch the user skips
        loss = self.loss(batch, batch_idx)
        if self.ex["scheduler"] and self.ex["scheduler"]["name"] == "ReduceLROnPlateau":
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        if self.automatic_optimization:
            return loss
        opts = self.optimizers()
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        clip = self.ex["clip"]
        for opt in opts:
            if clip:
                self.clip_gradients(opt, gradient_clip_val=clip["value"], gradient_clip_algorithm=clip["algorithm"])
            opt.step()
        sch = self.lr_schedulers()
        for s in (sch if isinstance(sch, list) else [sch] if sch is not None else []):
            if not isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
                s.step()
        return loss.detach()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # here, not in training_step: activation recompute's profile runs training_step once more
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs  # {} after a skipped batch
        self.losses.append(None if loss is None else float(loss.detach()))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_losses.append(float(self.loss(batch, batch_idx)))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.eval_out.append(float(self.loss(batch, batch_idx)))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.m["kind"] == "transformer":
            return self.net(*batch).detach()
        return self.net(batch[0] if isinstance(batch, (list, tuple)) else batch).detach()

    # -------------------------------------------------------------- optimizers

    def param_groups(self, params: list[nn.Parameter]) -> list[dict]:
        if not self.m["groups"]:
            return [{"params": params}]
        matrices = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        groups = [{"params": matrices}] if matrices else []
        if rest:  # biases and norms: no weight decay, another learning rate
            groups.append({"params": rest, "weight_decay": 0.0, "lr": 0.5 * self.ex["optimizer"]["kwargs"]["lr"]})
        return groups

    def configure_optimizers(self):
        o = self.ex["optimizer"]
        params = list(self.parameters())  # frozen ones too, as users pass them; tied ones once
        kwargs = dict(o["kwargs"])
        if self.perturb:
            kwargs["lr"] *= 1 + 1e-6  # the planted defect of the tester's own test
        if self.ex["optimization"] == "manual":
            half = max(1, len(params) // 2)
            second = self.ex["second"]
            opts = [make_optimizer(o["name"], self.param_groups(params[:half]), kwargs),
                    make_optimizer(second, [{"params": params[half:]}], SECOND_OPTIMIZERS[second])]
        else:
            opts = [make_optimizer(o["name"], self.param_groups(params), kwargs)]
        s = self.ex["scheduler"]
        if s is None:
            return opts if len(opts) > 1 else opts[0]
        configs = []
        for opt in opts:
            cfg: dict = {"scheduler": make_scheduler(s["name"], opt), "interval": s["interval"]}
            if s["name"] == "ReduceLROnPlateau":
                cfg.update(monitor="train_loss", interval="epoch")
            configs.append({"optimizer": opt, "lr_scheduler": cfg})
        return configs if len(configs) > 1 else configs[0]


def make_optimizer(name: str, groups: list[dict], kwargs: dict) -> torch.optim.Optimizer:
    cls = UserAdam if name == "UserAdam" else getattr(torch.optim, name)
    if name == "LBFGS":  # one group only
        return cls([p for g in groups for p in g["params"]], **kwargs)
    return cls(groups, **kwargs)


def _decay(step: int) -> float:
    return 0.8 ** step


def make_scheduler(name: str, opt: torch.optim.Optimizer) -> Any:
    S = torch.optim.lr_scheduler
    momentum = "momentum" in opt.defaults and opt.defaults["momentum"] or "betas" in opt.defaults
    lr = opt.defaults["lr"]
    return {
        "StepLR": lambda: S.StepLR(opt, step_size=2, gamma=0.5),
        "LambdaLR": lambda: S.LambdaLR(opt, _decay),
        "OneCycleLR": lambda: S.OneCycleLR(opt, max_lr=2 * lr, total_steps=64, cycle_momentum=bool(momentum)),
        "CosineAnnealingLR": lambda: S.CosineAnnealingLR(opt, T_max=4),
        "ExponentialLR": lambda: S.ExponentialLR(opt, gamma=0.9),
        "LinearLR": lambda: S.LinearLR(opt, start_factor=0.5, total_iters=3),
        "MultiStepLR": lambda: S.MultiStepLR(opt, milestones=[1, 3], gamma=0.5),
        "CosineAnnealingWarmRestarts": lambda: S.CosineAnnealingWarmRestarts(opt, T_0=2),
        "CyclicLR": lambda: S.CyclicLR(opt, base_lr=0.5 * lr, max_lr=2 * lr, step_size_up=2, cycle_momentum=False),
        "ReduceLROnPlateau": lambda: S.ReduceLROnPlateau(opt, patience=0, factor=0.5),
    }[name]()


def dataset(kind: str, n: int, seed: int) -> Dataset:
    """``n`` samples, the same on every rank (the sampler splits them)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "boring":
        state = torch.get_rng_state()
        torch.manual_seed(seed)
        data = RandomDataset(32, n)  # Lightning's own (draws from the global generator)
        torch.set_rng_state(state)
        return data
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return TensorDataset(x, (x * 5 + torch.arange(SEQ)) % VOCAB)


class RefClip(L.Callback):
    """The reference's GradNormBackoff without spikes: torch's own ``clip_grad_norm_`` over the optimizer's
    parameters at the same hook (gradients already averaged by DDP)."""

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, self.max_norm)


class NodeAverage(L.Callback):
    """The reference's local SGD: after every ``every``-th batch that stepped the optimizers, each parameter becomes
    the mean over the world, which is the mean of the nodes' (a node's ranks hold the same weights). With
    ``outer="nesterov"`` or ``overlap``, DiLoCo's outer step written out per parameter (docs/collectives.md): the
    anchor (the weights at the start) steps by the mean delta ``anchor - weights`` (Nesterov: ``v = 0.9 v + d``,
    ``anchor -= 0.7 (d + 0.9 v)``; average: ``anchor -= d``) and the weights become the anchor; overlapped, the
    mean delta of one sync is applied at the next, and the weights become the anchor plus the steps since."""

    def __init__(self, every: int, outer: str = "average", overlap: bool = False) -> None:
        self.every, self.outer, self.overlap = every, outer, overlap
        self.stepped = 0
        self._last_step = 0
        self.anchor: dict = {}
        self.velocity: dict = {}
        self.snapshot: dict = {}
        self.pending: dict = {}

    def on_train_start(self, trainer, pl_module):
        self.anchor = {p: p.detach().clone() for p in pl_module.parameters() if p.requires_grad}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self._last_step:
            return  # an accumulation micro-batch
        self._last_step = trainer.global_step
        self.stepped += 1
        if self.stepped % self.every:
            return
        world = torch.distributed.get_world_size()

        def mean(t: torch.Tensor) -> torch.Tensor:
            torch.distributed.all_reduce(t)
            return t.div_(world)

        with torch.no_grad():
            for p in pl_module.parameters():
                if not p.requires_grad:
                    continue
                if self.outer == "average" and not self.overlap:
                    mean(p.data)
                    continue
                a = self.anchor[p]
                if not self.overlap:
                    self._outer_step(p, mean(a - p))
                    p.copy_(a)
                    continue
                if p in self.pending:
                    self._outer_step(p, self.pending[p])
                    p.copy_(a + (p - self.snapshot[p]))
                self.snapshot[p] = p.detach().clone()
                self.pending[p] = mean(a - p)

    def _outer_step(self, p: torch.Tensor, d: torch.Tensor) -> None:
        if self.outer == "average":
            self.anchor[p].sub_(d)
            return
        v = self.velocity[p] = 0.9 * self.velocity.get(p, torch.zeros_like(d)) + d
        self.anchor[p].sub_(0.7 * (d + 0.9 * v))


def subject_class(ex: dict) -> type:
    """Subject, with ``configure_gradient_clipping`` only where the example clips there (a store steps after
    backward when the module overrides it)."""
    clip = ex["clip"]
    if not (clip and clip["where"] == "hook" and ex["optimization"] == "automatic"):
        return Subject

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=clip["value"], gradient_clip_algorithm=clip["algorithm"])

    return type("ClippingSubject", (Subject,), {"configure_gradient_clipping": configure_gradient_clipping})


__all__ = ["BATCH", "NodeAverage", "RefClip", "Subject", "UserAdam", "dataset", "make_optimizer", "make_scheduler",
           "subject_class"]
