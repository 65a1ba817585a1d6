"""The machine a benchmark runs on, as it measures: its facts, copy bandwidth, peak memory, the host memory left, an
out-of-memory error's figures, and a timer that waits for the device."""

from __future__ import annotations

import ctypes
import gc
import platform
import resource
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from ..storage.tensors import synced_clock


def machine(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory)
    return info


def copy_bandwidth(device: torch.device, megabytes: int = 256) -> float:
    """Measured memory bandwidth in bytes/s: best of 5 large copies, counting bytes read and written."""
    source = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        start = synced_clock(device)
        target.copy_(source)
        best = min(best, synced_clock(device) - start)
    return 2 * source.numel() * 4 / best


def reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        return_free_memory()
        try:  # Linux: "5" resets the process's peak resident set size (VmHWM)
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass


def return_free_memory() -> None:
    """Hand the C allocator's free pages back to the system (glibc), so that a run's resident-set
    peak is not inflated by what earlier, larger runs freed but the process kept."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = proc_bytes("/proc/self/status", "VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_available() -> int:
    """Bytes of host memory the system can still give (``MemAvailable``; unlimited where unknown)."""
    available = proc_bytes("/proc/meminfo", "MemAvailable")
    return available if available is not None else 1 << 62


def proc_bytes(path: str, field: str) -> int | None:
    """A ``field:  N kB`` line of a /proc file, in bytes (None: no such file or field)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def is_oom(error: BaseException) -> bool:
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(error).lower()


def oom_figures(error: BaseException) -> dict:
    """A row's record of an out-of-memory run: the allocator's first line (how much it asked for, how
    much was free) and the innermost kvcompress line that asked, so a report says where, not only that."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if "kvcompress" in frame.filename]
    where = f"{frames[-1].filename.rsplit('kvcompress', 1)[-1].lstrip('/')}:{frames[-1].lineno}" if frames else None
    return {
        "status": "oom",
        "error": str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__,
        "where": where,
    }


@dataclass
class Timer:
    """Wall-clock timing with CUDA events on a GPU (no host sync inside the timed region)."""

    device: torch.device

    def __post_init__(self) -> None:
        self.cuda = self.device.type == "cuda"

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms_since(self, start) -> float:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        return 1000 * (time.perf_counter() - start)

    def between(self, start, end) -> float:
        """Milliseconds from one ``start()`` stamp to a later one."""
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end)
        return 1000 * (end - start)
