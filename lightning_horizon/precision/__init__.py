"""HorizonPrecision: bf16 where the hardware makes it fast, fp32 where precision needs it, on any CPU.

Modes (``plugins=[HorizonPrecision(...)]``):

- ``"bf16-mixed"`` (``"auto"`` is an alias): parameters, gradients, micro-batch gradient accumulation and
  optimizer state in fp32; matmul-class ops under ``torch.autocast(bf16)`` when the compute dtype is bf16.
- ``"bf16-true"``: module weights stored in bf16, updated through a master the optimizer steps on:
  ``master="fp32"`` (an fp32 copy that stands in for the bf16 parameter in the optimizer's param groups during
  the step, with fp32 gradients, before ``on_before_optimizer_step``) or ``master="kahan"`` (a bf16 compensation buffer holding the low
  bits the bf16 weight cannot; the optimizer state is kept in bf16 between steps and upcast around the step).

``compute="auto"`` picks bf16 compute only where bf16 matmuls run in hardware (AVX512-BF16 or AMX on x86, BF16 on
Arm, a bf16 GPU). Elsewhere a bf16 matmul is emulated and 10-100x slower than fp32, so the weights are upcast and
everything computes in fp32 (bf16-true then still halves weight memory). Where bf16 is native, a model whose
matmuls are narrower than the measured crossover (``cpu.BF16_MIN_WIDTH``) also computes in fp32: bf16 is slower
there. Bytes per parameter: docs/precision.md.

The rooms: ``plugin.py`` (HorizonPrecision: validation, the choice of policy, what every mode shares),
``policy.py`` (the policy contract), ``mixed.py``, ``bf16_true.py`` (what both bf16-true policies share),
``fp32_master.py``, ``kahan.py`` (one policy per mode), ``ipex.py`` (the optional IPEX backend), ``compute.py``
(how wide a model's matmuls are: ``"auto"`` computes narrow ones in fp32). The memory
estimates of the modes (``held_bytes``, ``bytes_per_param``) are in ``lightning_horizon.memory``.
"""

from lightning_horizon.cpu import resolve_compute
from lightning_horizon.precision.compute import matmul_width
from lightning_horizon.precision.ipex import ipex_status
from lightning_horizon.precision.plugin import (
    BACKENDS,
    COMPUTES,
    MASTERS,
    MODES,
    STATE_ROUNDINGS,
    HorizonPrecision,
)

__all__ = [
    "BACKENDS",
    "COMPUTES",
    "MASTERS",
    "MODES",
    "STATE_ROUNDINGS",
    "HorizonPrecision",
    "ipex_status",
    "matmul_width",
    "resolve_compute",
]
