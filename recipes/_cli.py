"""What the recipes' LightningCLI programs share: lightning-horizon's defaults, two config fix-ups and the
automatic layout."""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

import torch
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

log = logging.getLogger("lightning_horizon.recipes")
HORIZON_STRATEGY = ("lightning_horizon.HorizonStrategy", "lightning_horizon.strategy.HorizonStrategy")


class FitByDefaultParser(LightningArgumentParser):
    """LightningCLI's parser, where no subcommand means ``fit`` (and ``--help`` does not call one required).

    Pass it as ``LightningCLI(parser_class=FitByDefaultParser)``. Only the top-level parser, the one with
    subcommands, inserts ``fit``; ``-h``/``--help`` without a subcommand shows the subcommands, as before.
    """

    _fit_by_default = False

    def add_subcommands(self, required: bool = True, dest: str = "subcommand", **kwargs: Any) -> Any:
        self._fit_by_default = True
        kwargs.setdefault("description", f"No subcommand means fit: `python {self.prog}` trains with the defaults,"
                          f" `python {self.prog} --config x.yaml` is `python {self.prog} fit --config x.yaml`. For"
                          " the options of one, add it followed by --help.")
        return super().add_subcommands(required=False, dest=dest, **kwargs)

    def parse_args(self, args: Optional[Any] = None, *rest: Any, **kwargs: Any) -> Any:
        given = sys.argv[1:] if args is None else args
        if (self._fit_by_default and isinstance(given, (list, tuple))
                and not set(given) & {*LightningCLI.subcommands(), "-h", "--help"}):
            args = ["fit", *given]
        return super().parse_args(args, *rest, **kwargs)


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


def horizon_class_path(strategy: Any) -> Any:
    """A registered name of HorizonStrategy (``--trainer.strategy=horizon``) as its class path with the name's
    settings, so that the layout can be set on it; any other strategy as it is."""
    from lightning_horizon.layout.script import horizon_name_settings

    settings = horizon_name_settings(strategy)
    return strategy if settings is None else Namespace(class_path=HORIZON_STRATEGY[0], init_args=Namespace(**settings))


def csv_logger_under(cfg: Any, root: str) -> None:
    """Make the default logger (``None``/``True``) a CSVLogger writing under ``root``/logs."""
    if cfg.trainer.logger in (None, True):
        cfg.trainer.logger = Namespace(class_path="lightning.pytorch.loggers.CSVLogger",
                                       init_args=Namespace(save_dir=root, name="logs"))


def auto_layout(cfg: Any, module_class: type, script: str) -> Optional[str]:
    """Take the tuned layout (else the rule's) when the user chose none; return the log line, or None.

    "Chose none" is ``trainer.devices: auto`` with HorizonStrategy and no ``threads_per_rank``. The config's
    ``data.batch_size`` is then the global batch, split over the ranks, so the layout changes the speed and not
    the training (the seeded sampler gives two ranks of 8 what one rank of 16 sees). The layout is
    ``lightning_horizon.layout.choose``'s for the module built from ``cfg.model`` on the meta device.
    """
    strategy = cfg.trainer.strategy = horizon_class_path(cfg.trainer.strategy)
    init = getattr(strategy, "init_args", None)
    if (cfg.trainer.devices != "auto" or getattr(strategy, "class_path", None) not in HORIZON_STRATEGY
            or init is None or init.get("threads_per_rank") is not None):
        return None
    from lightning_horizon.layout import model_sizes, workload
    from lightning_horizon.layout import choose
    from lightning_horizon.memory.probe import node_free_memory

    batch = cfg.data.batch_size
    with torch.device("meta"):  # the sizes and hyperparameters, without allocating the weights
        module = module_class(**cfg.model.as_dict())
    layout, why = choose(workload(module, batch, cfg.data.get("seq_len")), *model_sizes(module),
                         free_memory=node_free_memory())
    cfg.trainer.devices, init.threads_per_rank = layout.ranks, layout.threads
    cfg.data.batch_size = batch // layout.ranks
    if why.startswith("chosen by the launching process"):
        return None  # a rank Lightning's launcher started: the launching process said it
    measure = f" Measure with `python -m lightning_horizon.tune {script} <your arguments>`." if why.startswith("rule") \
        else ""
    return (f"layout {layout} (ranks x threads; global batch {batch} = {layout.ranks} x {batch // layout.ranks}):"
            f" {why}.{measure} Choose your own with --trainer.devices N --trainer.strategy.threads_per_rank T"
            " (data.batch_size is then per rank)")
