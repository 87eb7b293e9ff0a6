"""bf16-true with ``master="fp32"``: an fp32 copy of each bf16 weight that the optimizer steps, copied back into the
bf16 weight after each step. The masters are registered in the training state, the owner of the true weights."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_horizon.precision.bf16_true import Bf16TruePolicy
from lightning_horizon.precision.policy import cast_state


class FP32MasterPolicy(Bf16TruePolicy):
    """Between steps the optimizer holds the module's parameters, so that everything a LightningModule does with it
    (``zero_grad``, ``toggle_optimizer``, ``clip_gradients`` in manual optimization) acts on the tensors backward
    writes to. During the step (and while a state dict loads) the masters stand in."""

    master = "fp32"

    def describe(self) -> str:
        return "weights bf16 + fp32 master, grads fp32 (master), optimizer state fp32"

    def register(self, opt: Optimizer, p: Tensor) -> None:
        m = self.training_state.master(p)
        if m is None or not torch.equal(m.detach().to(torch.bfloat16), p.detach()):
            m = torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)  # weights changed
            self.training_state.register_master(p, m)
        if p in opt.state:  # state between steps is kept under the module parameter, in fp32
            opt.state[p] = cast_state(opt.state[p], p, torch.float32)

    def _before_load(self, opt: Optimizer, state_dict: dict[str, Any]) -> None:
        # torch casts loaded optimizer state to its parameter's dtype: load it while the fp32 masters stand in
        super()._before_load(opt, state_dict)
        self._swap_masters(opt, True)

    def _after_load(self, opt: Optimizer) -> None:
        super()._after_load(opt)
        self._swap_masters(opt, False)

    def step(self, optimizer: Optimizer, after_closure: Callable[[], None], kwargs: dict[str, Any]) -> Any:
        self._swap_masters(optimizer, True, grads=True)
        try:
            after_closure()  # the norm and the callbacks see the fp32 gradients the step uses
            out = optimizer.step(**kwargs)
            masters = [m for group in optimizer.param_groups for m in group["params"]]
            with torch.no_grad():  # out-of-core: one layer's masters and weights in memory at a time
                for run in self.training_state.stream(masters, dirty=True, kinds=("weight", "master")):
                    for m in run:
                        p = self.training_state.parameter_of(m)
                        if p is not m and m.grad is not None:  # a param without grad was not stepped
                            self.training_state.write(p, m)
            return out
        finally:
            self._swap_masters(optimizer, False, grads=True)

    def _swap_masters(self, optimizer: Optimizer, to_masters: bool, grads: bool = False) -> None:
        """Put the fp32 masters in the optimizer's param groups in place of their bf16 parameters, or back.

        With ``grads`` the gradients move along: in fp32 for the step, back in the parameter's dtype after it
        (clipped, or None for a skipped step: what the step used, as with fp32 parameters). The optimizer state
        moves along too, keyed by whoever is in the group.
        """
        state = self.training_state
        for group in optimizer.param_groups:
            for i, x in enumerate(group["params"]):
                new = state.master(x) if to_masters else state.parameter_of(x)
                if new is None or new is x:
                    continue
                if grads:
                    new.grad = None if x.grad is None else x.grad.detach().to(new.dtype)
                    x.grad = None
                group["params"][i] = new
                if x in optimizer.state:
                    optimizer.state[new] = optimizer.state.pop(x)

    def restore(self, param: Tensor, exact: Tensor, compensation: Optional[Tensor]) -> None:
        master = self.training_state.master(param)
        if master is not None:
            master.copy_(exact)
