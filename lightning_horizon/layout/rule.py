"""How a node's cores are split into ranks: the candidate layouts, the machine they are cut from, and the rule.

A layout is ``ranks x threads``: ranks per node (Lightning's ``devices``), each pinned to ``threads`` cores
(``HorizonStrategy(threads_per_rank=...)``). On a 16-core Xeon with AMX the small GPT trained 1.21-1.58x faster
as 4 x 4 than as 1 x 16 (docs/layout.md): one process's intra-op threads share every small op's fork-join
overhead and stream their weights from L3, while ranks run independently between gradient syncs. The measured
choice is ``python -m lightning_horizon.tune`` (tuner.py, cached by cache.py); where nothing was measured,
:func:`rule_layout` derives one from the machine and the model:

- threads per rank: the fewest whose share of the widest weight matrix fits in half a core's L2 cache (the
  other half holds the activation tiles); at least 1, at most a NUMA domain's cores, and one of the candidates
- ranks: the node's cores divided by that, fewer while the global batch does not split evenly over them or
  their replicated training state (weights, gradients, AdamW's moments, DDP's bucket copy, ~0.4 GiB of
  interpreter each) would not fit the free memory.
"""

from __future__ import annotations

import glob
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

import torch

from lightning_horizon import cpu
from lightning_horizon.checks import check_int, is_int, require

#: L2 per core assumed where sysfs does not say (bytes)
DEFAULT_L2 = 1 << 20
#: resident memory of one rank's interpreter, torch and Lightning before the model (measured here: ~0.35 GiB)
PROCESS_BYTES = 400 << 20
#: bytes per parameter byte a rank holds between steps: weights, gradients, AdamW's two moments, DDP's bucket copy
STATE_FACTOR = 5


@dataclass(frozen=True, order=True)
class Layout:
    """``ranks`` processes per node, ``threads`` intra-op threads each."""

    ranks: int
    threads: int

    def __post_init__(self) -> None:
        check_int("Layout", "ranks", self.ranks, 1)
        check_int("Layout", "threads", self.threads, 1)

    def __str__(self) -> str:
        return f"{self.ranks} x {self.threads}"

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """``"2x4"`` or ``"2 x 4"`` -> ``Layout(2, 4)``."""
        m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", str(text))
        require(m is not None and int(m[1]) >= 1 and int(m[2]) >= 1, "Layout.parse", "text", text,
                "'RANKSxTHREADS' with both >= 1, e.g. '4x4'")
        return cls(int(m[1]), int(m[2]))  # type: ignore[index]


@dataclass(frozen=True)
class Machine:
    """The facts a layout is cut from: the CPUs this process may use, their NUMA domains and caches."""

    cpu_model: str
    """Model name with family and model number (a hypervisor may show every AMD EPYC generation as "AMD EPYC")."""
    cores: int
    """CPUs this process may use (``os.sched_getaffinity`` at import: logical CPUs, hyperthreads included)."""
    domains: int = 1
    """NUMA domains among them; with several, each holds ``cores_per_domain`` (unequal domains count as one)."""
    l2_per_core: int = DEFAULT_L2
    """L2 cache bytes per CPU (a shared L2 divided among the CPUs sharing it)."""

    def __post_init__(self) -> None:
        check_int("Machine", "cores", self.cores, 1)
        check_int("Machine", "domains", self.domains, 1)
        require(self.cores % self.domains == 0, "Machine", "domains", self.domains,
                f"a divisor of cores={self.cores} (domains of equal size)")
        check_int("Machine", "l2_per_core", self.l2_per_core, 1)

    @property
    def cores_per_domain(self) -> int:
        return self.cores // self.domains

    @classmethod
    def here(cls) -> "Machine":
        """This machine, as this process sees it."""
        return _here()

    def describe(self) -> str:
        numa = f", {self.domains} NUMA domains" if self.domains > 1 else ""
        return f"{self.cpu_model}, {self.cores} cores{numa}, L2 {self.l2_per_core >> 10} KiB/core"


@lru_cache(maxsize=1)
def _here() -> Machine:
    cores = cpu.available_cores()
    per_domain = [len(set(cpus) & set(cores)) for cpus in cpu.numa_domains().values()]
    per_domain = [n for n in per_domain if n]
    domains = len(per_domain) if len(set(per_domain)) == 1 else 1
    return Machine(cpu_model=cpu_model(), cores=len(cores), domains=domains, l2_per_core=l2_per_core(cores[0]))


def cpu_model() -> str:
    """``"AMD EPYC (family 25, model 1)"`` from /proc/cpuinfo; the platform's processor name where there is none."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first CPU is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    import platform

    name = fields.get("model name") or fields.get("Model") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    return name


def l2_per_core(cpu_id: int = 0) -> int:
    """Bytes of L2 per CPU for ``cpu_id`` (sysfs); :data:`DEFAULT_L2` where sysfs does not say."""
    for index in sorted(glob.glob(f"/sys/devices/system/cpu/cpu{cpu_id}/cache/index*")):
        try:
            if _read(f"{index}/level") != "2" or _read(f"{index}/type") == "Instruction":
                continue
            size = _parse_size(_read(f"{index}/size"))
            sharing = len(cpu.parse_cpulist(_read(f"{index}/shared_cpu_list"))) or 1
        except (OSError, ValueError):
            continue
        return max(1, size // sharing)
    return DEFAULT_L2


def _read(path: str) -> str:
    with open(path) as f:  # closed at once: a file left to the garbage collector warns (ResourceWarning)
        return f.read().strip()


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text.upper())
    if m is None:
        raise ValueError(text)
    return int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[m[2]]


def _pow2_divisors(n: int) -> list[int]:
    """1, 2, 4, ... up to n that divide n, plus n itself: each rank gets an equal slice of the cores."""
    out = [1 << i for i in range(n.bit_length()) if n % (1 << i) == 0]
    return sorted(set(out) | {n})


def candidates(cores: int, domains: int = 1) -> list[Layout]:
    """The layouts worth measuring on ``cores`` CPUs in ``domains`` equal NUMA domains, fewest ranks first.

    Per domain: ``k`` ranks of ``cores_per_domain // k`` threads for every power of two ``k`` dividing the
    domain's cores, and one rank per core; the node runs ``domains * k`` ranks, so every rank stays inside one
    domain (the strategy's pinning cuts NUMA-ordered cores into contiguous slices). With several domains, the
    single process over every core (Lightning's default) is a candidate too. E.g. 12 cores: 1 x 12, 2 x 6,
    4 x 3, 12 x 1; 2 domains of 8: 1 x 16, 2 x 8, 4 x 4, 8 x 2, 16 x 1.
    """
    check_int("candidates", "cores", cores, 1)
    check_int("candidates", "domains", domains, 1)
    require(cores % domains == 0, "candidates", "domains", domains, f"a divisor of cores={cores}")
    per = cores // domains
    found = {Layout(domains * k, per // k) for k in _pow2_divisors(per)}
    return sorted(found | {Layout(1, cores)})


def model_sizes(module: torch.nn.Module) -> tuple[int, int]:
    """``(parameter bytes, bytes of the largest parameter)`` of ``module``, shared (tied) parameters counted once."""
    params = {id(p): p for p in module.parameters()}.values()
    sizes = [p.numel() * p.element_size() for p in params]
    return sum(sizes), max(sizes, default=0)


def rule_layout(
    param_bytes: int,
    largest_bytes: int,
    machine: Optional[Machine] = None,
    global_batch: Optional[int] = None,
    free_memory: Optional[int] = None,
) -> tuple[Layout, str]:
    """The layout without measuring (see the module's docstring) and the reason, for the log.

    ``param_bytes`` / ``largest_bytes``: the model's parameters and its largest one, in bytes (:func:`model_sizes`);
    ``global_batch``: samples per optimizer step over every rank (ranks must divide it); ``free_memory``: bytes the
    node can give (``None``: not checked).
    """
    machine = machine or Machine.here()
    for name, value, low in (("param_bytes", param_bytes, 0), ("largest_bytes", largest_bytes, 0)):
        check_int("rule_layout", name, value, low)
    if global_batch is not None:
        check_int("rule_layout", "global_batch", global_batch, 1)
    if free_memory is not None:
        check_int("rule_layout", "free_memory", free_memory, 0)
    options = sorted((c for c in candidates(machine.cores, machine.domains)
                      if c.ranks % machine.domains == 0), key=lambda c: c.threads)
    need = max(1, math.ceil(largest_bytes / (machine.l2_per_core / 2)))
    fits = [c for c in options if c.threads >= need] or [options[-1]]
    why = (f"rule: largest weight {largest_bytes / 2**20:.2f} MiB over half of {machine.l2_per_core >> 10} KiB L2"
           f" per core -> >= {need} thread(s) per rank" + ("" if fits[0].threads >= need else
                                                          f" (capped at {fits[0].threads}, a domain's cores)"))
    per_rank = STATE_FACTOR * param_bytes + PROCESS_BYTES
    for layout in fits:  # most ranks first
        if global_batch is not None and global_batch % layout.ranks:
            why += f"; {layout.ranks} ranks do not split batch {global_batch}"
            continue
        if free_memory is not None and layout.ranks > 1 and layout.ranks * per_rank > free_memory:
            why += (f"; {layout.ranks} ranks x {per_rank / 2**30:.2f} GiB exceed the"
                    f" {free_memory / 2**30:.1f} GiB free")
            continue
        return layout, why
    return Layout(1, machine.cores), why + "; one rank"


def workload(module: Any, global_batch: int, seq_len: Optional[int]) -> dict[str, Any]:
    """What a tuned layout is valid for: the LightningModule's class and hyperparameters (``save_hyperparameters``;
    private ones and those that change no step's cost, :data:`SPEED_NEUTRAL`, left out), the global batch and the
    sequence length."""
    check_int("workload", "global_batch", global_batch, 1)
    require(seq_len is None or is_int(seq_len, 1), "workload", "seq_len", seq_len, "an int >= 1 or None")
    hparams = dict(getattr(module, "hparams", None) or {})
    # private entries ("_instantiator", which LightningCLI adds) say how the module was built, not what it runs
    kept = {k: v for k, v in hparams.items() if k not in SPEED_NEUTRAL and not k.startswith("_")}
    # the class's own name: a script's module is "__main__" when run, "pretrain_gpt" when imported
    return {"module": type(module).__qualname__, "hparams": kept,
            "global_batch": global_batch, "seq_len": seq_len}


#: hyperparameters that change what a step computes with, not what it costs: a new learning rate keeps the layout
SPEED_NEUTRAL = frozenset({"lr", "learning_rate", "min_lr_ratio", "warmup_steps", "weight_decay", "betas", "eps",
                           "seed"})

__all__ = ["DEFAULT_L2", "Layout", "Machine", "SPEED_NEUTRAL", "candidates", "cpu_model", "l2_per_core",
           "model_sizes", "rule_layout", "workload"]
