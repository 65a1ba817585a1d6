"""The CPU kernel of a decoding step over 8- or 4-bit coded slots (``cpu_decode.cpp``), built on first use.

Decoding every kept token before attending costs more than the attention on a CPU: PyTorch's ops read the codes, write
the decoded float32 tokens and read them again (eagerly, in ~8 ops per buffer per layer), so 4 bits made SnapKV 1024's
step 1.4-1.6x slower than 32 (docs/quantization.md). The kernel attends the codes as they are, the decoding folded
into the dot products (per group, ``q.k = scale * q.codes + minimum * sum(q)``), split along the slots over the
intra-op threads. It is compiled with the machine's C++ compiler through ``torch.utils.cpp_extension`` (the same
compiler ``torch.compile`` needs on a CPU) into torch's extension cache, once per machine, source and torch; where it
cannot be built (no compiler, no ninja) a warning says so once and the coded slots are decoded first, as before.
``KVCOMPRESS_CPU_KERNEL=0`` turns it off (comparisons)."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("cpu_decode.cpp")


def _machine_tag() -> str:
    """The CPU's instruction sets, hashed: the kernel is built for this machine's (``-march=native``), and a
    cache shared by machines with other CPUs must not hand it to them."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


@functools.cache
def cpu_kernel() -> ModuleType | None:
    """The built extension (``coded_decode_attention``), or None where it is turned off or does not build here."""
    if os.environ.get("KVCOMPRESS_CPU_KERNEL", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            f"kvcompress_cpu_decode_{_machine_tag()}", SOURCE.read_text(), functions=["coded_decode_attention"],
            extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as error:  # noqa: BLE001 -- a compiler's or ninja's failure, whatever its type
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        warnings.warn(f"kvcompress: the CPU decoding kernel did not build here ({first_line}); coded slots are "
                      "decoded before attention (slower)", stacklevel=2)
        return None


@torch.compiler.assume_constant_result
def has_cpu_kernel() -> bool:
    """Whether ``cpu_kernel`` is there (a compiled step bakes the answer in; the eager first step built it)."""
    return cpu_kernel() is not None
