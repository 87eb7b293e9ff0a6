"""bf16-mixed: fp32 parameters, gradients (micro-batches accumulate in fp32) and optimizer state; the matmul-class
ops under ``torch.autocast(bf16)`` when the compute dtype is bf16, plain fp32 otherwise."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional

from torch import Tensor

from lightning_horizon.precision.policy import Policy


class MixedPolicy(Policy):
    """fp32 weights that are their own truth: nothing is registered in the training state."""

    ipex_compatible = True

    @property
    def precision(self) -> str:
        return "bf16-mixed" if self.compute == "bf16" else "32-true"

    def describe(self) -> str:
        return "weights, grads and optimizer state fp32"

    def forward_context(self) -> Any:
        return self.autocast() if self.compute == "bf16" else nullcontext()

    def restore(self, param: Tensor, exact: Tensor, compensation: Optional[Tensor]) -> None:
        param.copy_(exact)  # fp32 parameters take the full-precision weights of a bf16-true checkpoint
