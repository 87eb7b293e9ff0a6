"""Tuned layouts kept on disk, and the choice a training script makes from them: tuned if measured, else the rule.

One JSON file (``~/.cache/lightning_horizon/layouts.json``; ``HORIZON_LAYOUT_CACHE`` or a ``path`` argument
moves it) holds one entry per key. The key hashes the workload (:func:`lightning_horizon.layout.workload`: the
module's class and hyperparameters, global batch, sequence length) with the machine (CPU model, family and model
number, cores this process may use, NUMA domains, ISA including a oneDNN cap, torch version): a layout measured
on one CPU, core count or torch says nothing about another. The file is replaced atomically (temporary file,
fsync, rename); a file that does not parse is ignored with a warning and replaced by the next store.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_horizon import cpu
from lightning_horizon.checkpoint_io import atomic_file
from lightning_horizon.layout.rule import Layout, Machine, rule_layout

CACHE_ENV = "HORIZON_LAYOUT_CACHE"
#: ``KEY|RANKSxTHREADS|REASON``: the layout :func:`choose` took, for the ranks Lightning's launcher starts (they
#: re-run the script, and must take the same layout even where the free memory, and so the rule, moved meanwhile)
CHOSEN_ENV = "HORIZON_LAYOUT_CHOSEN"
_VERSION = 1


def cache_path(path: Optional[str | os.PathLike] = None) -> Path:
    """``path``, else ``$HORIZON_LAYOUT_CACHE``, else ``lightning_horizon/layouts.json`` under ``$XDG_CACHE_HOME``
    (``~/.cache``)."""
    if path is None:
        path = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
            "lightning_horizon" / "layouts.json"
    return Path(path).expanduser()


def machine_facts(machine: Optional[Machine] = None) -> dict[str, Any]:
    """The machine part of the key."""
    machine = machine or Machine.here()
    return {"cpu_model": machine.cpu_model, "cores": machine.cores, "domains": machine.domains,
            "isa": cpu.isa().description, "torch": torch.__version__}


def _canonical(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))  # tuples -> lists, odd types -> str


def key(workload: dict[str, Any], machine: Optional[Machine] = None) -> str:
    """The cache key of ``workload`` on ``machine`` (this one by default): 16 hex digits."""
    text = json.dumps({"workload": _canonical(workload), "machine": machine_facts(machine)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load(path: Optional[str | os.PathLike] = None) -> dict[str, dict[str, Any]]:
    """Every entry of the cache file by key; empty when there is none, or (with a warning) when it does not parse."""
    p = cache_path(path)
    try:
        data = json.loads(p.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("no 'entries' object")
        return data["entries"]
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        warnings.warn(f"layout cache {p} ignored ({e}); the next tuning run replaces it", stacklevel=2)
        return {}


def store(workload: dict[str, Any], entry: dict[str, Any], path: Optional[str | os.PathLike] = None,
          machine: Optional[Machine] = None) -> str:
    """Add or replace ``workload``'s entry (``entry`` holds at least ``ranks`` and ``threads``); return its key."""
    Layout(entry["ranks"], entry["threads"])  # a bad entry fails here, not in the next run that reads it
    p = cache_path(path)
    entries = load(p)
    k = key(workload, machine)
    entries[k] = {"tuned_at": datetime.datetime.now().isoformat(timespec="seconds"), **entry,
                  "workload": _canonical(workload), "machine": machine_facts(machine)}
    text = json.dumps({"version": _VERSION, "entries": entries}, indent=1, sort_keys=True)
    with atomic_file(p) as f:
        f.write(text.encode())
    return k


def lookup(workload: dict[str, Any], path: Optional[str | os.PathLike] = None,
           machine: Optional[Machine] = None) -> Optional[dict[str, Any]]:
    """``workload``'s tuned entry on this machine, or None."""
    return load(path).get(key(workload, machine))


def choose(
    workload: dict[str, Any],
    param_bytes: int,
    largest_bytes: int,
    free_memory: Optional[int] = None,
    path: Optional[str | os.PathLike] = None,
    machine: Optional[Machine] = None,
) -> tuple[Layout, str]:
    """The tuned layout of ``workload`` when the cache has one, else :func:`rule_layout`'s; and why, for the log.

    The choice is also left in ``$HORIZON_LAYOUT_CHOSEN``, where the processes this one starts find it: a call
    there with the same workload returns it unchanged (its reason prefixed with ``"chosen by the launching
    process: "``)."""
    machine = machine or Machine.here()
    k = key(workload, machine)
    inherited = os.environ.get(CHOSEN_ENV, "").split("|", 2)
    if len(inherited) == 3 and inherited[0] == k:
        return Layout.parse(inherited[1]), f"chosen by the launching process: {inherited[2]}"
    entry = load(path).get(k)
    if entry is not None:
        layout = Layout(entry["ranks"], entry["threads"])
        speed = f", {entry['throughput']:,.0f} {entry.get('unit', 'samples/s')}" if entry.get("throughput") else ""
        why = f"tuned {entry.get('tuned_at', '?')[:10]}{speed} ({cache_path(path)})"
    else:
        layout, why = rule_layout(param_bytes, largest_bytes, machine, workload.get("global_batch"), free_memory)
    os.environ[CHOSEN_ENV] = f"{k}|{layout.ranks}x{layout.threads}|{why}"
    return layout, why


__all__ = ["CACHE_ENV", "CHOSEN_ENV", "cache_path", "choose", "key", "load", "lookup", "machine_facts", "store"]
