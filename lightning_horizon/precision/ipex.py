"""The optional Intel Extension for PyTorch backend: whether it is usable here, and ``ipex.optimize`` for training.

IPEX 2.8 (its last release, end-of-life) pins torch 2.8: it is detected at run time, and anything else falls back
to native torch with a message.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning.pytorch.utilities.rank_zero import rank_zero_only

log = logging.getLogger("lightning_horizon.precision")


def ipex_status() -> tuple[Any, str]:
    """``(ipex, "")`` when intel_extension_for_pytorch imports and matches torch's major.minor, else ``(None, why)``."""
    try:
        import intel_extension_for_pytorch as ipex  # type: ignore[import-not-found]
    except ImportError:
        return None, "intel_extension_for_pytorch is not installed (its last release, 2.8, needs torch 2.8.*)"
    except Exception as err:  # a mismatched build can fail while loading its C++ extension
        return None, f"intel_extension_for_pytorch failed to import: {type(err).__name__}: {err}"
    want = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    have = ".".join(str(getattr(ipex, "__version__", "?")).split("+")[0].split(".")[:2])
    if have != want:
        return None, f"intel_extension_for_pytorch {ipex.__version__} does not match torch {torch.__version__}"
    return ipex, ""


def ipex_optimize(module: Module, optimizers: list[Optimizer], backend: str, compatible: bool,
                  compute: str) -> list[Optimizer]:
    """``ipex.optimize`` applied to ``module`` and its one optimizer (in place) when IPEX is usable and the precision
    policy is ``compatible`` with it (fp32 weights the optimizer owns); otherwise the optimizers as they are, with
    the reason logged (a warning where ``backend="ipex"`` asked for it). ``backend="auto"`` leaves a step that
    computes in fp32 (a CPU without native bf16) to native torch: there IPEX measured no faster and held more
    memory (docs/precision.md)."""
    ipex, why = ipex_status()
    fp32_auto = backend == "auto" and compute == "fp32"
    if ipex is None or not compatible or len(optimizers) != 1 or fp32_auto:
        if ipex is not None and fp32_auto and compatible:
            why = ("fp32 compute (no native bf16): ipex.optimize measured no faster than native torch here;"
                   " backend='ipex' applies it anyway")
        elif ipex is not None:  # without an optimizer ipex.optimize would apply inference-only rewrites
            why = "ipex.optimize is applied when training with mode='bf16-mixed' and one optimizer"
        level = logging.WARNING if backend == "ipex" else logging.INFO
        if rank_zero_only.rank == 0:
            log.log(level, "HorizonPrecision(backend=%r): using native torch: %s", backend, why)
        return optimizers
    # fp32 weights (autocast does the bf16 part); prepacking replaces parameters, which a DDP wrapper
    # built before this point would not see, so only a single process prepacks
    distributed = (torch.distributed.is_available() and torch.distributed.is_initialized()
                   and torch.distributed.get_world_size() > 1)
    _, optimizer = ipex.optimize(module, optimizer=optimizers[0], inplace=True, weights_prepack=not distributed)
    if rank_zero_only.rank == 0:
        log.info("HorizonPrecision: ipex %s optimize(weights_prepack=%s)", ipex.__version__, not distributed)
    return [optimizer]
