"""The CPU a rank runs on: instruction sets, NUMA domains, per-rank core pinning, threads, allocator.

Pinning is what makes several ranks on one machine fast: without it the ranks' OpenMP pools oversubscribe the
cores and migrate between NUMA domains. Each local rank gets a disjoint, contiguous slice of the cores this
process may use, ordered by NUMA domain so that a slice stays inside one domain whenever the ranks divide the
domains evenly. With fewer cores than ranks the cores are shared round-robin, and the caller warns.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

import torch

# The affinity this process started with, before any pinning: a second fit in the same process must plan
# from the whole machine again, not from the slice the first fit pinned it to.
_START_AFFINITY: Optional[frozenset[int]] = (
    frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
)

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

#: oneDNN runs torch's bf16 matmuls. Capped (``ONEDNN_MAX_CPU_ISA``, formerly ``DNNL_MAX_CPU_ISA``) at one of
#: these it has no bf16 dot-product instruction and emulates them (measured here: 2.7 against 98 GFLOP/s fp32 at
#: AVX2), whatever the CPU has: the cap is how a CPU without native bf16 is reproduced on one with it.
ONEDNN_ISA_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
_ONEDNN_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                  "AVX512_CORE_VNNI"})


#: The narrowest matmuls at which bf16 compute beat fp32 end to end, by ISA name: below this width (the FLOP-weighted
#: smaller side of a model's weight matrices, precision/compute.py) ``compute="auto"`` computes in fp32. A GPT's
#: training step, bf16 autocast against fp32, 2 threads (docs/precision.md): n_embd 64 0.70x (Intel Xeon, AMX) and
#: 0.85x (AMD Zen 4, AVX512-BF16); n_embd 128 1.13x and 1.20x. Arm BF16 is unmeasured: the ISA alone decides there.
BF16_MIN_WIDTH = {"AMX": 96, "AVX512-BF16": 96}


@dataclass(frozen=True)
class ISA:
    """The vector instruction sets that decide which kernels are fast on this CPU."""

    avx2: bool
    avx512: bool
    avx512_bf16: bool
    amx: bool
    arm_bf16: bool
    torch_capability: str  # what torch's dispatcher uses: "DEFAULT", "AVX2", "AVX512", ...
    onednn_cap: str = ""  # ONEDNN_MAX_CPU_ISA when set, upper-cased: caps the ISA of torch's matmuls

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls run in hardware (AVX512-BF16, AMX, Arm BF16) and oneDNN is not capped below them;
        elsewhere they are emulated and slow."""
        return (self.avx512_bf16 or self.amx or self.arm_bf16) and self.onednn_cap not in _ONEDNN_WITHOUT_BF16

    @property
    def bf16_min_width(self) -> int:
        """The narrowest matmul width at which bf16 compute wins here (:data:`BF16_MIN_WIDTH`; 0: any width)."""
        return BF16_MIN_WIDTH.get(self.name, 0) if self.native_bf16 else 0

    @property
    def name(self) -> str:
        """The best instruction set found, for tables."""
        for flag, label in ((self.amx, "AMX"), (self.avx512_bf16, "AVX512-BF16"), (self.arm_bf16, "ARM-BF16"),
                            (self.avx512, "AVX-512"), (self.avx2, "AVX2")):
            if flag:
                return label
        return "baseline"

    @property
    def description(self) -> str:
        """torch's kernel level plus the bf16 extensions, for log lines: e.g. "AVX512 + AVX512-BF16"."""
        extras = [label for flag, label in ((self.avx512_bf16, "AVX512-BF16"), (self.amx, "AMX-BF16"),
                                            (self.arm_bf16, "ARM-BF16")) if flag]
        capped = f" (oneDNN capped at {self.onednn_cap})" if self.onednn_cap else ""
        return " + ".join([self.torch_capability, *extras]) + capped


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo ("flags" on x86, "Features" on Arm); empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa() -> ISA:
    """The ISA from the CPU flags, cross-checked with torch's own CPU capability (and its cpuinfo probe where
    there is no /proc/cpuinfo)."""
    flags = cpu_flags()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # an exotic build
        capability = "DEFAULT"
    avx512_bf16 = "avx512_bf16" in flags
    if not flags:  # no /proc/cpuinfo: ask torch's cpuinfo probe (a torch without this public one: no claim)
        capabilities = getattr(torch.cpu, "get_capabilities", None)
        avx512_bf16 = bool(capabilities and capabilities().get("avx512_bf16", False))
    return ISA(
        avx2="avx2" in flags or capability.startswith("AVX"),
        avx512="avx512f" in flags or capability.startswith("AVX512"),
        avx512_bf16=avx512_bf16,
        amx="amx_bf16" in flags,
        arm_bf16="bf16" in flags,
        torch_capability=capability,
        onednn_cap=next((os.environ[v] for v in ONEDNN_ISA_VARS if os.environ.get(v)), "").strip().upper(),
    )


def resolve_compute(compute: str, device_type: str = "cpu", width: Optional[float] = None) -> tuple[str, str]:
    """The compute dtype ("bf16" or "fp32") for ``compute`` (``"auto"``, ``"bf16"`` or ``"fp32"``) on
    ``device_type``, and the reason, for the log: ``"auto"`` picks bf16 only where bf16 matmuls run in hardware and,
    given the model's matmul ``width`` (precision/compute.py), where they are wide enough for bf16 to win."""
    if device_type == "cuda":
        found, ok, narrowest = "CUDA", torch.cuda.is_available() and torch.cuda.is_bf16_supported(), 0
    elif device_type == "cpu":
        found_isa = isa()
        found, ok, narrowest = found_isa.description, found_isa.native_bf16, found_isa.bf16_min_width
    else:
        found, ok, narrowest = device_type, False, 0
    have = "native bf16" if ok else "no native bf16"
    if compute != "auto":
        slow = "" if ok or compute == "fp32" else " (expect bf16 matmuls to be many times slower than fp32)"
        return compute, f"ISA found: {found}; {have}; compute={compute!r} forced{slow}"
    if ok and width is not None and width < narrowest:
        return "fp32", (f"ISA found: {found}; {have}, but the model's matmuls are narrow (width {width:.0f} <"
                        f" {narrowest}, where bf16 is slower than fp32 here) -> fp32 compute; pass compute='bf16'"
                        " to force")
    if ok:
        return "bf16", f"ISA found: {found}; {have} -> bf16 compute; pass compute='fp32' to force fp32"
    return "fp32", f"ISA found: {found}; {have} -> fp32 compute; pass compute='bf16' to force"


def parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_domains() -> dict[int, list[int]]:
    """NUMA domain -> the CPUs in it, from sysfs; one domain holding every CPU where sysfs says nothing."""
    domains: dict[int, list[int]] = {}
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist")):
        node = int(re.search(r"node(\d+)", path).group(1))  # type: ignore[union-attr]
        with open(path) as f:
            cpus = parse_cpulist(f.read())
        if cpus:
            domains[node] = cpus
    return domains or {0: sorted(_START_AFFINITY or range(os.cpu_count() or 1))}


def available_cores() -> list[int]:
    """The CPUs this process may run on, ordered by NUMA domain then id."""
    allowed = _START_AFFINITY if _START_AFFINITY is not None else frozenset(range(os.cpu_count() or 1))
    domain_of = {cpu: node for node, cpus in numa_domains().items() for cpu in cpus}
    return sorted(allowed, key=lambda c: (domain_of.get(c, 0), c))


def plan_cores(local_rank: int, local_world_size: int, cores: list[int]) -> tuple[list[int], bool]:
    """This local rank's cores and whether they are shared with another rank.

    With at least as many cores as ranks, rank ``i`` gets the ``i``-th of ``local_world_size`` contiguous
    slices (the first ``len(cores) % local_world_size`` slices one core larger). With fewer cores than ranks,
    rank ``i`` gets core ``i % len(cores)``, shared.
    """
    n = len(cores)
    if n >= local_world_size:
        base, extra = divmod(n, local_world_size)
        start = local_rank * base + min(local_rank, extra)
        return cores[start : start + base + (local_rank < extra)], False
    return [cores[local_rank % n]], True


def pin_rank(local_rank: int, local_world_size: int, pin_cores: bool, threads: Optional[int] = None) -> dict[str, Any]:
    """This rank's cores, threads and whether its cores are shared: pinned to its own slice (``pin_cores``), or
    left on every core the process may use with torch's own thread count."""
    if not pin_cores:
        return {"cores": sorted(available_cores()), "threads": torch.get_num_threads(), "shared": False}
    cores, shared = plan_cores(local_rank, local_world_size, available_cores())
    return {"cores": cores, "threads": pin(cores, threads), "shared": shared}


#: what pinning changes in a process: the OpenMP variables, the affinity and torch's thread count
_PINNED_VARS = (*_THREAD_VARS, "KMP_BLOCKTIME", "KMP_AFFINITY")


@dataclass(frozen=True)
class ThreadSettings:
    """A process's thread settings before Lightning's launcher and our pinning changed them, to give back at teardown."""

    env: dict[str, Optional[str]]
    affinity: Optional[frozenset[int]]
    threads: int

    @classmethod
    def capture(cls) -> "ThreadSettings":
        affinity = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return cls({v: os.environ.get(v) for v in _PINNED_VARS}, affinity, torch.get_num_threads())

    def restore(self) -> None:
        for var, value in self.env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        if self.affinity is not None:
            os.sched_setaffinity(0, self.affinity)
        set_threads(self.threads)


def pin(cores: list[int], threads: Optional[int] = None) -> int:
    """Pin this process to ``cores`` and size torch's intra-op pool; return the thread count.

    The OpenMP variables are set too, for the processes this one starts and for runtimes that read them at
    their first parallel region; ``torch.set_num_threads`` takes effect immediately in this process.
    """
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    threads = _thread_count(cores, threads)
    for var in _THREAD_VARS:
        os.environ[var] = str(threads)
    # Intel OpenMP (IPEX, oneDNN builds): spin briefly, then sleep, and keep threads on their cores. GNU OpenMP
    # (PyPI's torch) ignores these. A user's own setting wins.
    os.environ.setdefault("KMP_BLOCKTIME", "1")
    os.environ.setdefault("KMP_AFFINITY", "granularity=fine,compact,1,0")
    set_threads(threads)
    return threads


def set_threads(threads: int) -> None:
    """``torch.set_num_threads(threads)`` where the count differs. The call costs even where the count is unchanged:
    afterwards the same training step makes ~50k more futex calls (OpenMP regions waking their threads; the small GPT
    on 2 cores, fp32 on the AVX2 path) and ran 0.2-2.6% slower in each of 4 interleaved pairs (docs/benchmarks.md)."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def planned_threads(local_rank: int, local_world_size: int, threads: Optional[int] = None) -> int:
    """The intra-op threads ``pin_rank(local_rank, local_world_size, pin_cores=True, threads)`` will give this rank."""
    return _thread_count(plan_cores(local_rank, local_world_size, available_cores())[0], threads)


def _thread_count(cores: list[int], threads: Optional[int]) -> int:
    """The intra-op threads of a rank pinned to ``cores``: ``threads`` where given, else one per core."""
    return threads or len(cores)


def machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has used since boot (/proc/stat; 0 where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def allocator() -> Optional[str]:
    """``"jemalloc"`` or ``"tcmalloc"`` when one is loaded into this process (e.g. via LD_PRELOAD), else None."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        maps = os.environ.get("LD_PRELOAD", "")
    for name in ("jemalloc", "tcmalloc"):
        if f"lib{name}" in maps:
            return name
    return None


#: jemalloc settings that keep freed pages (as intel-extension-for-pytorch's launcher sets them): jemalloc's own
#: defaults hand pages back to the OS and fault them in again every step (docs/benchmarks.md: least RSS, slowest)
JEMALLOC_CONF = ("oversize_threshold:1,background_thread:true,metadata_thp:auto,dirty_decay_ms:-1,"
                 "muzzy_decay_ms:-1")
#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: What ``keep_freed_memory`` sets: blocks up to 256 MiB come from the heap (not a fresh mmap each), and the heap's
#: free top goes back to the kernel only beyond 2 GiB (mallopt takes an int). A training step frees what the next
#: one allocates again: glibc's defaults hand it back and fault it in again, 30-55k page faults per step of the small
#: GPT here, 40-100 ms of system time (docs/strategy.md#allocator).
KEEP_THRESHOLDS = {_M_MMAP_THRESHOLD: 256 << 20, _M_TRIM_THRESHOLD: (1 << 31) - 1}
#: glibc's defaults in their steady state, set again at teardown: mmap from 32 MiB (the ceiling its dynamic
#: threshold reaches by itself) and trim a free top beyond 128 KiB
GLIBC_THRESHOLDS = {_M_MMAP_THRESHOLD: 32 << 20, _M_TRIM_THRESHOLD: 128 << 10}
#: the same knobs set from the environment (glibc's variables and tunables): a user's own setting wins
_GLIBC_KNOBS = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")


def _glibc_malloc() -> Optional[ctypes.CDLL]:
    """This process's C library where glibc's malloc is the allocator and its thresholds are glibc's own (no jemalloc
    or tcmalloc loaded, no ``MALLOC_MMAP_THRESHOLD_``-like variable, no such ``GLIBC_TUNABLES`` entry)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if allocator() is not None or any(f"MALLOC_{k.upper()}_" in os.environ or f"glibc.malloc.{k}" in tunables
                                      for k in _GLIBC_KNOBS):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc, not musl or macOS's libc
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep the memory a step frees for the next step (``KEEP_THRESHOLDS``); False where
    malloc is not glibc's or is configured already (then nothing changes)."""
    libc = _glibc_malloc()
    return libc is not None and all(libc.mallopt(k, v) == 1 for k, v in KEEP_THRESHOLDS.items())


def release_freed_memory() -> None:
    """After ``keep_freed_memory``: glibc's thresholds in their default steady state again, and the free memory
    handed back to the kernel (``malloc_trim``)."""
    libc = _glibc_malloc()
    if libc is not None:
        for k, v in GLIBC_THRESHOLDS.items():
            libc.mallopt(k, v)
        libc.malloc_trim(0)


# one short line in the startup table; the commands are in docs/strategy.md#allocator
ALLOCATOR_HINT = "malloc is glibc's; jemalloc (LD_PRELOAD) keeps less memory: docs/strategy.md#allocator"
