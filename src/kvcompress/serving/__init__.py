"""Serving through vLLM: what serving needs without vLLM (``settings``: the servable methods, a request's own
settings, a model family's checks, the engine's and the server's arguments, the memory it reserves) and the plugin
vLLM loads in every process (``vllm_plugin``: an attention backend, a KV connector, a scheduler, an API-server
middleware), imported by vLLM only.

It may import methods, the transformers integration, cache and storage; nothing imports it but the front.
"""

from .settings import SERVABLE, check_servable, engine_options, method_of, scorable  # the offline API: docs/vllm.md

__all__ = ["SERVABLE", "check_servable", "engine_options", "method_of", "scorable"]
