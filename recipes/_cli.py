"""What the recipes' LightningCLI programs share: lightning-horizon's defaults and two config fix-ups."""

from __future__ import annotations

from typing import Any, Optional

from jsonargparse import Namespace


def horizon_precision_default() -> Optional[dict]:
    """HorizonPrecision("auto") as a config entry, or None (plain fp32) where lightning_horizon.precision is absent."""
    try:
        import lightning_horizon.precision  # noqa: F401
    except ImportError:
        return None
    return {"class_path": "lightning_horizon.precision.HorizonPrecision", "init_args": {"mode": "auto"}}


def drop_unset_ddp_args(strategy: Any) -> None:
    """Remove the unset (None) DDP keywords jsonargparse fills in for a strategy's ``**kwargs``.

    jsonargparse follows HorizonStrategy's ``**kwargs`` into DDPStrategy and DistributedDataParallel and passes
    every keyword it finds there with its default, including ``output_device``/``device_ids``/``process_group``,
    which the strategy sets itself and rejects by name. None means "not given" for all of them.
    """
    init_args = getattr(strategy, "init_args", None)
    if init_args is None:
        return
    for name in ("output_device", "device_ids", "process_group", "bucket_cap_mb"):
        if name in init_args and init_args[name] is None:
            del init_args[name]


def csv_logger_under(cfg: Any, root: str) -> None:
    """Make the default logger (``None``/``True``) a CSVLogger writing under ``root``/logs."""
    if cfg.trainer.logger in (None, True):
        cfg.trainer.logger = Namespace(class_path="lightning.pytorch.loggers.CSVLogger",
                                       init_args=Namespace(save_dir=root, name="logs"))
