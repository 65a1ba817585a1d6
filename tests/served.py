"""A `kvcompress serve` process for the vLLM tests (started as a user starts it, on 127.0.0.1), and the library's
answers to compare its answers with."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvcompress import demo
from kvcompress.serving import launch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`kvcompress serve` with ``flags``, its output in ``log``; ``base`` is its address once ``start`` returns."""

    def __init__(self, flags: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.port, self.log_path = free_port(), log
        self.base = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "kvcompress", "serve", "--port", str(self.port), *flags]
        self.log = open(log, "w")
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})},
        )

    def start(self, timeout: float = 600) -> Server:
        deadline = time.monotonic() + timeout
        while not launch.ready(self.base):
            assert self.process.poll() is None and time.monotonic() < deadline, self.output()[-3000:]
            time.sleep(2)
        return self

    def output(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        """SIGINT, as a user stops it; its exit status."""
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=60)
        finally:
            self.process.kill()
            self.log.close()

    def idle(self, timeout: float = 30) -> bool:
        """Whether vLLM's running-requests and KV-usage gauges fall to 0 within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        gauges = ("vllm:num_requests_running", "vllm:kv_cache_usage_perc")
        while any(launch.gauge(self.base, name) for name in gauges):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True


def chat(tokenizer, tokens: int, depth: float) -> list[dict]:
    """The demo's buried fact at ``depth`` of about ``tokens`` tokens of prose, and its question."""
    document = demo.build_document(tokenizer, tokens, depth)
    return [{"role": "user", "content": f"Read this document.\n\n{document}\n\n{demo.QUESTION}"}]
