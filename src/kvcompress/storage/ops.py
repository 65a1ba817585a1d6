"""Fused operations of a decoding step as torch custom ops: one dispatched op each, however many
tensor ops their torch implementation takes, and one Triton kernel on a GPU (``kernels.py``).

``fused`` turns a function written with torch ops into the custom op ``kvcompress::<name>``: that
function runs on every device, except on CUDA where the Triton kernel of the same name in
``kernels.py`` runs when Triton is installed. A compiled step calls the op as one opaque node (a
fake implementation gives its output's shape). ``triton_everywhere`` runs the kernels on every
device: with ``TRITON_INTERPRET=1`` that is Triton's CPU interpreter, how the tests check them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
from collections.abc import Callable, Iterator

import torch

_everywhere = False  # the Triton kernels on every device (tests, through Triton's interpreter)
TRITON = importlib.util.find_spec("triton") is not None  # installed: the fused ops run their kernels on CUDA


@contextlib.contextmanager
def triton_everywhere() -> Iterator[None]:
    """Run the fused ops' Triton kernels whatever the device (needs Triton; on a CPU, ``TRITON_INTERPRET=1``)."""
    global _everywhere
    _everywhere = True
    try:
        yield
    finally:
        _everywhere = False


def runs_triton(device_type: str) -> bool:
    """Whether the fused ops run their Triton kernels for tensors on ``device_type``."""
    return _everywhere or (device_type == "cuda" and TRITON)


def triton_kernel(name: str) -> Callable:
    from . import kernels  # noqa: PLC0415 - imported on first use: it needs Triton

    return getattr(kernels, name)


def fused(name: str, mutates_args: tuple[str, ...], fake: Callable) -> Callable[[Callable], Callable]:
    """Register the decorated torch implementation as ``kvcompress::name`` (see the module docstring);
    ``kernels.<name>_triton`` is its CUDA kernel. ``fake(*args)`` returns an empty output of the right shape."""

    def register(implementation: Callable) -> Callable:
        @functools.wraps(implementation)
        def anywhere(*args, **kwargs):
            if _everywhere:
                return triton_kernel(f"{name}_triton")(*args, **kwargs)
            return implementation(*args, **kwargs)

        anywhere.__signature__ = inspect.signature(implementation, eval_str=True)  # type: ignore[attr-defined]
        op = torch.library.custom_op(f"kvcompress::{name}", anywhere, mutates_args=mutates_args)
        op.register_fake(fake)
        if TRITON:
            op.register_kernel("cuda", lambda *args, **kwargs: triton_kernel(f"{name}_triton")(*args, **kwargs))
        return op

    return register
