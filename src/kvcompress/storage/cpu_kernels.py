"""The CPU kernel of a decoding step over 8- or 4-bit coded slots (``cpu_decode.cpp``), built on first use.

Decoding every kept token before attending costs more than the attention on a CPU: PyTorch's ops read the codes, write
the decoded float32 tokens and read them again (eagerly, in ~8 ops per buffer per layer), so 4 bits made SnapKV 1024's
step 1.4-1.6x slower than 32 (docs/quantization.md). The kernel attends the codes as they are, the decoding folded
into the dot products (per group, ``q.k = scale * q.codes + minimum * sum(q)``), split along the slots over the
intra-op threads. It is compiled with the machine's C++ compiler through ``torch.utils.cpp_extension`` (the same
compiler ``torch.compile`` needs on a CPU) into torch's extension cache (``$TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions/py<version>_cpu/kvcompress_cpu_decode_<tag>``), once per machine, source and torch
install (~25 s on a 2-core VM); ``generate`` builds it before its clock starts and reports the time apart
(``kernel_build_s``). Where it cannot be built (no compiler, no ninja) a warning says so once and the coded slots are
decoded first, as before.
``KVCOMPRESS_CPU_KERNEL=0`` turns it off (comparisons)."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("cpu_decode.cpp")


def _build_tag() -> str:
    """What a build is for, hashed into its name (so its own folder): the CPU's instruction sets (it is built with
    ``-march=native``, and a cache shared by machines with other CPUs must not hand it to them), the kernel's source,
    and the torch it links (version and install: two environments each keep their build, where one shared folder
    records one's paths and each rebuilt it in turn)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    built_for = f"{platform.machine()} {flags} {SOURCE.read_text()} {torch.__version__} {Path(torch.__file__).parent}"
    return hashlib.sha256(built_for.encode()).hexdigest()[:10]


@functools.cache
def cpu_kernel() -> ModuleType | None:
    """The built extension (``coded_decode_attention``), or None where it is turned off or does not build here."""
    if os.environ.get("KVCOMPRESS_CPU_KERNEL", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline  # noqa: PLC0415 - only when the kernel is built

        return load_inline(
            f"kvcompress_cpu_decode_{_build_tag()}", SOURCE.read_text(), functions=["coded_decode_attention"],
            extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as error:  # noqa: BLE001 -- a compiler's or ninja's failure, whatever its type
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        warnings.warn(f"kvcompress: the CPU decoding kernel did not build here ({first_line}); coded slots are "
                      "decoded before attention (slower)", stacklevel=2)
        return None


def ready_cpu_kernel() -> float:
    """Build (or load) the kernel now, before a clock starts: the seconds it took this time (0.0 once it is loaded,
    or where it is turned off)."""
    if cpu_kernel.cache_info().currsize:
        return 0.0
    start = time.perf_counter()
    cpu_kernel()
    return time.perf_counter() - start


@torch.compiler.assume_constant_result
def has_cpu_kernel() -> bool:
    """Whether ``cpu_kernel`` is there (a compiled step bakes the answer in; the eager first step built it)."""
    return cpu_kernel() is not None
