"""What the layout tuner checks about a training script before any layout runs: its shape (a LightningCLI with
subcommands, or ``run=False``), its strategy (HorizonStrategy, by class path or by name) and its batch option, all
from one ``--print_config`` of the script with the user's arguments."""

from __future__ import annotations

import importlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml
from lightning.pytorch.strategies import StrategyRegistry

from lightning_horizon.strategy import HorizonStrategy


class ScriptShapeError(ValueError):
    """The script cannot be tuned as it is; the message says what the tuner needs."""


@dataclass
class ScriptShape:
    """How the tuner runs a script (:func:`inspect_script`)."""

    subcommand: bool
    """a LightningCLI with subcommands (the worker runs ``fit``); False: ``LightningCLI(run=False)``"""
    strategy_args: list[str]
    """arguments that make the script's strategy a class path the layout's ``threads_per_rank`` can be given to"""


def inspect_script(script: str, script_args: Sequence[str], batch_arg: Optional[str], env: dict[str, str],
                   timeout: float = 300) -> ScriptShape:
    """Read ``script``'s configuration with ``script_args`` (LightningCLI's ``--print_config``; a script with
    subcommands gets ``fit``, a ``run=False`` one none) and check what the tuner needs: a LightningCLI program whose
    Trainer trains with HorizonStrategy and, when ``batch_arg`` is given, has that option (``env``: the workers'
    environment). Raises :class:`ScriptShapeError` saying what is missing."""
    args = [a for i, a in enumerate(script_args) if not (i == 0 and a == "fit")]
    if args and args[0] in ("validate", "test", "predict"):
        raise ScriptShapeError(f"the tuner runs the script's fit: drop {args[0]!r} from its arguments")
    source = Path(script).read_text(errors="replace")
    order = [False, True] if "run=False" in source.replace(" ", "") else [True, False]
    for subcommand in order:
        cmd = [sys.executable, script, *(["fit"] if subcommand else []), *args, "--print_config"]
        shown = " ".join([Path(script).name, *cmd[2:]])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            raise ScriptShapeError(f"`{shown}` printed no configuration within {timeout:.0f} s: the tuner needs a"
                                   " LightningCLI script") from None
        err = proc.stderr.lower()
        if proc.returncode == 0 and proc.stdout.strip():
            return _check_config(_config(proc.stdout), subcommand, batch_arg, script)
        if ("unrecognized arguments: fit" in err and subcommand) or ('expected "subcommand"' in err and not subcommand):
            continue  # the other shape
        tail = " / ".join(line.strip() for line in (proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise ScriptShapeError(f"`{shown}` failed (exit {proc.returncode}): {tail[-400:] or 'no output'}. The tuner"
                               " needs a LightningCLI script whose fit it can start with these arguments")
    raise ScriptShapeError(f"{script} accepts neither `fit` nor no subcommand: the tuner needs a LightningCLI script")


def _config(text: str) -> dict[str, Any]:
    """The YAML of ``--print_config`` (after whatever the script printed at import: LightningCLI's header starts it)."""
    start = text.find("# lightning.pytorch==")
    try:
        cfg = yaml.safe_load(text[start:] if start >= 0 else text)
    except yaml.YAMLError:
        cfg = None
    return cfg if isinstance(cfg, dict) else {}


def _check_config(cfg: dict[str, Any], subcommand: bool, batch_arg: Optional[str], script: str) -> ScriptShape:
    trainer = cfg.get("trainer")
    if not isinstance(trainer, dict):
        raise ScriptShapeError(f"{script}'s configuration has no trainer section: the tuner needs a LightningCLI"
                               " script (its layout goes in as --trainer.devices and --trainer.strategy.*)")
    strategy = trainer.get("strategy")
    strategy_args: list[str] = []
    if isinstance(strategy, dict) and _is_horizon(strategy.get("class_path")):
        pass
    elif horizon_name_settings(strategy) is not None:
        # a name takes no options on the command line: its class path does, with the name's settings
        strategy_args = ["--trainer.strategy=lightning_horizon.HorizonStrategy",
                         *(f"--trainer.strategy.{k}={v}" for k, v in horizon_name_settings(strategy).items())]
    else:
        shown = strategy.get("class_path") if isinstance(strategy, dict) else strategy
        raise ScriptShapeError(f"{script} trains with strategy={shown!r}: the tuner measures HorizonStrategy's layouts"
                               " (ranks x threads_per_rank); add --trainer.strategy=lightning_horizon.HorizonStrategy"
                               " to the script's arguments, or set it in its config")
    if batch_arg is not None and not _has_option(cfg, batch_arg):
        raise ScriptShapeError(f"{script}'s configuration has no {batch_arg}, where the tuner puts the per-rank batch"
                               " of a layout with several ranks: name that option with --batch-arg, or pass --layouts"
                               " with one rank only")
    return ScriptShape(subcommand, strategy_args)


def horizon_name_settings(strategy: Any) -> Optional[dict[str, Any]]:
    """The settings (``start_method``, ...) behind a registered name of HorizonStrategy (``"horizon"``, any case),
    or None for anything else: what its class path needs to be the same strategy."""
    name = strategy.lower() if isinstance(strategy, str) else None
    if name not in StrategyRegistry or not issubclass(StrategyRegistry[name]["strategy"], HorizonStrategy):
        return None
    return dict(StrategyRegistry[name]["init_params"])


def _is_horizon(class_path: Any) -> bool:
    if not isinstance(class_path, str) or "." not in class_path:
        return False
    module, _, name = class_path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return False
    return isinstance(found, type) and issubclass(found, HorizonStrategy)


def _has_option(cfg: dict[str, Any], dotted: str) -> bool:
    """Whether ``dotted`` (``data.batch_size``) names a value of ``cfg``, looking through ``init_args`` as
    LightningCLI's ``--data.batch_size`` does for a class given by class path."""
    node: Any = cfg
    for key in dotted.split("."):
        if isinstance(node, dict) and key not in node and isinstance(node.get("init_args"), dict):
            node = node["init_args"]
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


__all__ = ["ScriptShape", "ScriptShapeError", "horizon_name_settings", "inspect_script"]
