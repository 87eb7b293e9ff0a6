"""The int8 codec's C kernel (``int8_codec.c``): built once per machine with its C compiler, loaded with ctypes.

The codec in torch ops is five passes over memory for an encode (absolute values, block maxima, divide, round,
clamp) and two more for the error; the kernel does encode and error in one, block by block in the L1 cache, and
decodes and sums a chunk's rows in one. ctypes releases the GIL for the call, so gloo's threads carry the bytes of
other chunks meanwhile.

The library is built with ``-O3 -march=native`` into ``$HORIZON_KERNEL_CACHE`` (default
``~/.cache/lightning_horizon``), under a name that hashes the source, the compiler's version and the CPU's flags (a
cache shared between unlike machines keeps one build per CPU), written to a temporary file and renamed, so ranks
that build at once never load half a file. Without a compiler, or with ``HORIZON_NATIVE_CODEC=0``, the codec runs on
torch ops and gives the same bytes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int8_codec.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-strict-aliasing", "-fPIC", "-shared"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, _cpu_flags(), *FLAGS]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("HORIZON_KERNEL_CACHE") or Path.home() / ".cache" / "lightning_horizon")
    lib = cache / f"int8_codec-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so.tmp")
        os.close(fd)
        try:
            subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, check=True)
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return lib


@functools.lru_cache(maxsize=None)
def int8_kernel() -> Optional[ctypes.CDLL]:
    """The loaded kernel, or ``None`` (no compiler, a failed build, or ``HORIZON_NATIVE_CODEC=0``), said once."""
    if os.environ.get("HORIZON_NATIVE_CODEC", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        log.info("int8 codec: no C compiler found (cc, gcc or $CC): it runs on torch ops, several passes over memory")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("int8 codec: building its C kernel with %s failed, it runs on torch ops: %s", cc, detail.strip())
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.horizon_int8_encode.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.horizon_int8_encode.restype = None
    lib.horizon_int8_decode.argtypes = [ptr, i64, i64, i64, i64, ptr, ctypes.c_int]
    lib.horizon_int8_decode.restype = None
    return lib
