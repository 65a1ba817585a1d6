"""Serving through vLLM: what serving needs without vLLM (``serving``: the servable methods, a request's own
settings, a model family's checks, the engine's and the server's arguments) and the plugin vLLM loads
(``plugin``: an attention backend, a KV connector, a scheduler, an API-server middleware), imported by vLLM only.

It may import methods, the transformers integration, cache and storage; nothing imports it but the front.
"""
