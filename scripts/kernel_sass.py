"""The split decoding kernel's Hopper build, counted without a GPU: SASS instructions and global loads per variant.

    PYTHONPATH=. python scripts/kernel_sass.py          # the 8B shape's: head_dim 128, 4 query rows, 64-slot blocks

Triton's compiler and the ptxas it bundles build the kernel for sm_90 as a launch on an H100/H200 would (arguments
divisible by 16 marked so, as Triton specializes them); ``cuobjdump`` from the same bundle lists the machine code.
A load per channel shows as hundreds of narrow ``LDG.E.U8``/``U16``; rows read whole show as few wide ones
(``LDG.E.128``, ``LDGSTS``: asynchronous copies). A proxy for the kernel's cost where no GPU is at hand, not a time.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import triton

from tests.test_decode_kernel import build_decode_kernel

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def sass_counts(key_bits: int, value_bits: int, dim: int, rows: int) -> tuple[int, Counter]:
    """(instructions, global loads by kind) of one variant's sm_90 build."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(build_decode_kernel(key_bits, value_bits, dim, rows))
        cubin.flush()
        sass = subprocess.run([str(CUOBJDUMP), "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
    code = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/\s+[A-Z@]", line)]
    return len(code), Counter(re.search(r"LDG\S*", line).group(0) for line in code if "LDG" in line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=4, help="query heads per KV head")
    args = parser.parse_args()
    for key_bits, value_bits in ((0, 0), (8, 8), (4, 4), (6, 4)):
        total, loads = sass_counts(key_bits, value_bits, args.dim, args.rows)
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(loads.items()))
        print(
            f"keys {key_bits or 16:>2} bits, values {value_bits or 16:>2}: {total:5d} instructions, "
            f"{sum(loads.values()):4d} loads ({kinds})"
        )


if __name__ == "__main__":
    main()
