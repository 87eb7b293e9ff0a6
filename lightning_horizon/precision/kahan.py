"""bf16-true with ``master="kahan"``: bf16 weights plus a bf16 compensation holding the low bits the bf16 weight
cannot (registered in the training state), and bf16 optimizer state between steps, rounded stochastically or to
nearest. The optimizer steps fp32 proxies of the parameters, a bounded chunk at a time."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_horizon.optim import step_in_parts
from lightning_horizon.precision.bf16_true import Bf16TruePolicy
from lightning_horizon.precision.policy import cast_state, per_element
from lightning_horizon.state import TrainingState

_NOISE = 1 << 16  # elements in a stochastic-rounding noise window


class KahanPolicy(Bf16TruePolicy):
    """The parameters never change dtype (which would reset their grad accumulators and with them DDP's gradient
    hooks): the optimizer's param groups briefly hold fp32 proxies (weight + compensation, fp32 grad, fp32 state)
    instead of the bf16 parameters."""

    master = "kahan"

    def __init__(self, training_state: TrainingState, state_rounding: str, step_chunk_numel: int, seed: int) -> None:
        super().__init__(training_state)
        self.state_rounding = state_rounding
        self.step_chunk_numel = step_chunk_numel
        self.rounding = StochasticRounding(seed)

    def describe(self) -> str:
        return f"weights bf16 + bf16 Kahan compensation, grads bf16, optimizer state bf16 ({self.state_rounding})"

    def register(self, opt: Optimizer, p: Tensor) -> None:
        if self.training_state.compensation(p) is None:  # a kept one holds at most half an ulp: harmless
            self.training_state.register_compensation(p, torch.zeros_like(p, dtype=torch.bfloat16))

    def step(self, optimizer: Optimizer, after_closure: Callable[[], None], kwargs: dict[str, Any]) -> Any:
        """Step fp32 proxies of the bf16 parameters, chunk by chunk, and fold the results back."""
        after_closure()  # the norm and the callbacks see the bf16 gradients on the parameters
        groups = optimizer.param_groups
        todo = [(i, p) for i, g in enumerate(groups) for p in g["params"] if p.grad is not None]
        self.rounding.new_step()
        if not todo:  # nothing to update (e.g. a skipped step): still one call, so step hooks run as usual
            return optimizer.step(**kwargs)
        return step_in_parts(optimizer, self._chunks(todo), lambda chunk: self._step_chunk(optimizer, chunk, kwargs))

    def _chunks(self, todo: list[tuple[int, Tensor]]) -> list[list[tuple[int, Tensor]]]:
        """``(group index, parameter)`` pairs cut into runs of at most ``step_chunk_numel`` elements (or one)."""
        chunks: list[list[tuple[int, Tensor]]] = [[]]
        size = 0
        for i, p in todo:
            if chunks[-1] and size + p.numel() > self.step_chunk_numel:
                chunks.append([])
                size = 0
            chunks[-1].append((i, p))
            size += p.numel()
        return chunks

    def _step_chunk(self, optimizer: Optimizer, chunk: list[tuple[int, Tensor]], kwargs: dict[str, Any]) -> Any:
        groups = optimizer.param_groups
        proxies = [(p, self._proxy(optimizer, p)) for _, p in chunk if self.training_state.compensation(p) is not None]
        stepped = dict(proxies)
        for i, p in chunk:  # a parameter without compensation (not bf16) steps as it is
            groups[i]["params"].append(stepped.get(p, p))
        try:
            return optimizer.step(**kwargs)
        finally:
            for p, w in proxies:
                self._fold(optimizer, p, w)
            self.training_state.settle(optimizer, [p for _, p in chunk])  # out-of-core: into the store, released

    @torch.no_grad()
    def _proxy(self, optimizer: Optimizer, p: Tensor) -> Tensor:
        """The fp32 true weight (bf16 weight + compensation) with an fp32 grad, owning p's state in fp32."""
        w = self.training_state.read(p)
        w.grad = p.grad.detach().float()
        state = optimizer.state.pop(p, None)
        if state:
            optimizer.state[w] = cast_state(state, p, torch.float32)
        return w

    @torch.no_grad()
    def _fold(self, optimizer: Optimizer, p: Tensor, w: Tensor) -> None:
        """Round the stepped fp32 weight into bf16 weight + bf16 compensation (the residual); state back to bf16."""
        self.training_state.write(p, w)  # bf16 weight rounded to nearest, the residual into the compensation
        state = optimizer.state.pop(w, None)
        if not state:
            return
        optimizer.state[p] = state
        for k, x in list(state.items()):
            if per_element(k, x, p) and x.dtype != torch.bfloat16:
                state[k] = x.to(torch.bfloat16) if self.state_rounding == "nearest" else self.rounding(x)

    # ------------------------------------------------------------------ checkpoint

    def restore(self, param: Tensor, exact: Tensor, compensation: Optional[Tensor]) -> None:
        comp = self.training_state.compensation(param)
        if comp is not None:  # the saved compensation as it is: param may not be restored yet
            comp.copy_(compensation if compensation is not None else exact - param.float())

    def rng_state(self) -> dict[str, Tensor]:
        return self.rounding.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.load_rng_state(state_dict.get("rng", {}))

    def load_rng_state(self, state: dict[str, Tensor]) -> None:
        self.rounding.load_state_dict(state)


class StochasticRounding:
    """fp32 -> bf16 by stochastic rounding, from a seeded generator per device (resumes exactly).

    Keeps slow averages such as Adam's ``exp_avg_sq`` (beta2=0.999) unbiased where round-to-nearest freezes them
    once a step's change is below bf16's half-ulp.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}
        self._noise: Optional[Tensor] = None

    def new_step(self) -> None:
        """Draw a fresh noise block at the next rounding."""
        self._noise = None

    def __call__(self, x: Tensor) -> Tensor:
        """Add a uniform fraction of one bf16 ulp to the 16 bits bf16 drops, then truncate (unbiased). The noise is
        a window, at a random offset, of a block drawn once per step, added with a broadcast: a fresh draw per
        element costs more than the whole optimizer step."""
        gen = self._generator(x.device)
        if self._noise is None or self._noise.device != x.device:
            self._noise = torch.empty(2 * _NOISE, dtype=torch.int32, device=x.device).random_(0, 1 << 16, generator=gen)
        off = int(torch.randint(0, _NOISE, (1,), generator=gen, device=gen.device))
        block = self._noise[off : off + _NOISE]
        bits = x.contiguous().view(torch.int32).view(-1)
        full = bits.numel() - bits.numel() % _NOISE
        if full:
            bits[:full].view(-1, _NOISE).add_(block)
        bits[full:].add_(block[: bits.numel() - full])
        return bits.bitwise_and_(-65536).view(torch.float32).view(x.shape).to(torch.bfloat16)  # exact

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device)
            self._generators[key].manual_seed(self.seed)
        return self._generators[key]

    def state_dict(self) -> dict[str, Tensor]:
        return {k: g.get_state() for k, g in self._generators.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        for key, rng in state.items():
            self._generator(torch.device(key)).set_state(rng)
