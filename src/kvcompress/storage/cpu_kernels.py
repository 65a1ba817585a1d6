"""The CPU kernel of a decoding step over 8- or 4-bit coded slots (``cpu_decode.cpp``), built on first use.

Decoding every kept token before attending costs more than the attention on a CPU: PyTorch's ops read the codes, write
the decoded float32 tokens and read them again (eagerly, in ~8 ops per buffer per layer), so 4 bits made SnapKV 1024's
step 1.4-1.6x slower than 32 (docs/quantization.md). The kernel attends the codes as they are, the decoding folded into
the dot products (per group, ``q.k = scale * q.codes + minimum * sum(q)``), split along the slots over the intra-op
threads. It is compiled with the machine's C++ compiler for a fixed instruction set (``build_target``) through
``torch.utils.cpp_extension`` (the same compiler ``torch.compile`` needs on a CPU) into torch's extension cache
(``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions/py<version>_cpu/kvcompress_cpu_decode_<tag>``), once
per machine, source and torch install (~25 s on a 2-core VM); ``generate`` builds it before its clock starts and reports
the time apart (``kernel_build_s``). Where it cannot be built (no compiler, no ninja) a warning says so once and the
coded slots are decoded first, as before.
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


X86_64_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe"}  # x86-64-v3's features as /proc/cpuinfo names them


def _cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return set(next((line for line in lines if line.startswith("flags")), "").split())


def build_target() -> list[str]:
    """The instruction set the kernel is compiled for: on x86-64 a fixed level, not the build machine's own
    (with ``-march=native`` the build machine chose the vector width, and so the order of the kernel's float sums and
    their last bits: issue 81); every CPU with AVX2 and FMA runs the same instructions (x86-64-v3, 256-bit vectors),
    older ones the baseline. Other architectures keep their compiler's native target."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["-march=native"]
    return ["-march=x86-64-v3", "-mtune=generic"] if X86_64_V3 <= _cpu_flags() else ["-march=x86-64", "-mtune=generic"]


def _build_tag() -> str:
    """What a build is for, hashed into its name (so its own folder): its instruction set (a cache shared by machines
    of another level must not hand it to them), the kernel's source, and the torch it links (version and install: two
    environments each keep their build, where one shared folder records one's paths and each rebuilt it in turn)."""
    torch_install = f"{torch.__version__} {Path(torch.__file__).parent}"
    built_for = f"{platform.machine()} {build_target()} {SOURCE.read_text()} {torch_install}"
    return hashlib.sha256(built_for.encode()).hexdigest()[:10]


@functools.cache
def cpu_kernel() -> ModuleType | None:
    """The built extension (``coded_decode_attention``), or None where it is turned off or does not build here."""
    if os.environ.get("KVCOMPRESS_CPU_KERNEL", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline  # noqa: PLC0415 - only when the kernel is built

        return load_inline(
            f"kvcompress_cpu_decode_{_build_tag()}",
            SOURCE.read_text(),
            functions=["coded_decode_attention"],
            extra_cflags=["-O3", *build_target(), "-fno-math-errno", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # noqa: BLE001 -- a compiler's or ninja's failure, whatever its type
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        warnings.warn(
            f"kvcompress: the CPU decoding kernel did not build here ({first_line}); coded slots are "
            "decoded before attention (slower)",
            stacklevel=2,
        )
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
