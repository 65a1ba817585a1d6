"""PH"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import urllib.request
from typing import Any

from ..methods.base import Method
from ..methods.fields import InvalidParameterError
from .settings import CONNECTOR, MIDDLEWARE, SCHEDULER, engine_settings


def serve_argv(model: str, method: Method, host: str, port: int, vllm_flags: list[str]) -> list[str]:
    """The arguments of vLLM's OpenAI-compatible server: the model, the plugin's scheduler and request
    middleware, the engine's method, the address, then the user's own vLLM flags (``vllm serve --help``)."""
    return [
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--scheduler-cls",
        SCHEDULER,
        "--middleware",
        MIDDLEWARE,
        "--kv-transfer-config",
        json.dumps(CONNECTOR),
        "--additional-config",
        json.dumps(engine_settings(method)),
        "--shutdown-timeout",
        "30",
        *vllm_flags,  # SIGINT/SIGTERM: finish, then stop
    ]


GiB = 1 << 30


# vLLM's API server and engine processes (0.7 and 0.6 GiB resident here, serving the embedded model), which start
# after `kvcompress serve` reads the free memory and before vLLM's worker checks its reservation against it
SERVER_PROCESSES = 3 * GiB // 2


VLLM_DEFAULT_UTILIZATION = 0.92  # vLLM's --gpu-memory-utilization, on the CPU build the share of the NUMA node reserved


UTILIZATION = ("--gpu-memory-utilization", "--device-memory-utilization")


KV_BYTES = "--kv-cache-memory-bytes"


KV_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB of KV cache, vLLM's older setting


def flag_value(flags: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the last of ``names`` in ``flags`` (``--name value`` or ``--name=value``), None if absent."""
    found = None
    for i, flag in enumerate(flags):
        name, eq, value = flag.partition("=")
        if name in names:
            found = value if eq else (flags[i + 1] if i + 1 < len(flags) else "")
    return found


def memory_flags(
    flags: list[str], total: int, available: int, env: dict[str, str], parse_bytes: Any = int
) -> list[str]:
    """The flags that size vLLM's CPU build to the memory that is free, checked before vLLM starts (it would refuse in
    its worker, with a wall of tracebacks). With none of --gpu-memory-utilization, --kv-cache-memory-bytes or
    VLLM_CPU_KVCACHE_SPACE given: a utilization reserving the free memory but a headroom for the server's other
    processes (vLLM's default, 0.92 of the node, fails wherever other processes hold memory). What the user gave is
    kept, or refused in one line saying what fits. ``total``/``available``: the memory node's bytes, as vLLM reads them;
    ``parse_bytes``: vLLM's reading of a byte count ("4G")."""
    room = available - SERVER_PROCESSES  # what vLLM's worker will find free
    fits = math.floor(100 * min(VLLM_DEFAULT_UTILIZATION, max(room - available // 10, 0) / total)) / 100  # 10% spare
    free = f"{available / GiB:.1f} GiB of this machine's {total / GiB:.1f} GiB are free"
    kv_bytes, env_gib, most = flag_value(flags, (KV_BYTES,)), env.get(KV_ENV, ""), max(room, 0) // GiB
    if env_gib:  # vLLM's CPU build takes the environment's over the flag
        asked, given, fix = int(env_gib) * GiB, f"{KV_ENV}={env_gib}", f"set {KV_ENV} to at most {most}"
    elif kv_bytes is not None:
        asked, given, fix = parse_bytes(kv_bytes), f"{KV_BYTES} {kv_bytes}", f"give at most {KV_BYTES} {most}G"
    if env_gib or kv_bytes is not None:
        if asked > room:
            raise InvalidParameterError(
                f"{given} asks for {asked / GiB:.1f} GiB of KV cache and {free}; {fix}, "
                "or leave it out to size it from the free memory"
            )
        return []
    utilization = flag_value(flags, UTILIZATION)
    if utilization is not None:
        if float(utilization) * total > room:
            fix = (
                "stop other processes"
                if fits * total < 2 * GiB
                else (f"pass --gpu-memory-utilization {fits:.2f}, or {KV_BYTES} 4G, or leave both out")
            )
            reserved = f"{float(utilization) * total / GiB:.1f} GiB"
            raise InvalidParameterError(f"--gpu-memory-utilization {utilization} reserves {reserved} and {free}; {fix}")
        return []
    if fits * total < 2 * GiB:
        raise InvalidParameterError(
            f"kvcompress serve needs about 2 GiB for the model and its KV cache and {free}; "
            f"pass {KV_BYTES} with what fits, or stop other processes"
        )
    return ["--gpu-memory-utilization", f"{fits:.2f}"]


def quiet_teardown() -> None:
    """An exit handler for `kvcompress serve`'s processes, registered before vLLM's own so that it runs after them:
    what the interpreter's teardown prints from then on goes to /dev/null. The extension modules vLLM loads (Triton's,
    built with nanobind) list there the objects they never freed, 28 lines after a clean stop that say nothing about
    the server."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


def dtype_flags(flags: list[str], on_cpu: bool) -> list[str]:
    """The precision a server runs in when the user names none: on a CPU the library's, float32 (vLLM's ``--dtype
    auto`` serves a float32 checkpoint in bfloat16 there, where near-tied tokens part from the library's and a small
    model's answers can run in loops); elsewhere vLLM's own."""
    return ["--dtype", "float32"] if on_cpu and flag_value(flags, ("--dtype",)) is None else []


def ready(base: str) -> bool:
    """Whether the server at ``base`` (``http://host:port``) answers its health check."""
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def gauge(base: str, name: str) -> float:
    """A gauge of the server's Prometheus endpoint (``vllm:num_requests_running``, ...), summed over its labels."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((name + "{", name + " ")))


class QuietStop(logging.Filter):
    """Drops the one error vLLM's API server logs when a deliberate stop races its output loop: once the server
    says its shutdown was triggered (SIGINT/SIGTERM), the loop still awaiting the engine it is stopping reports
    the engine dead, with a traceback saying it "encountered an issue" (vLLM 0.32 stops the engine before it
    cancels that loop; plain vLLM logs it too, 1 stop in 4 here). Any other error, and that one before a stop,
    is kept."""

    LOGGERS = ("vllm.entrypoints.launchers.launcher", "vllm.v1.engine.async_llm")  # where each record is logged

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().endswith("shutdown triggered"):
            self.stopping = True
        error = record.exc_info[1] if record.exc_info else None
        return not (self.stopping and type(error).__name__ == "EngineDeadError")

    def install(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
