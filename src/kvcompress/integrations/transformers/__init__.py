"""The transformers integration, where kvcompress reaches into a model (the cache layer below only subclasses
transformers' public ``Cache`` and ``DynamicLayer``): the "kvcompress" attention
implementation, mask and input check, model checks and ``make_cache`` (``attach``), rotary helpers from a
model's own rotary module (``rope``), the long-prompt prefill's wrappers (``longprompt``: blocks, chunked MLPs,
masks built by block) and ``load_model`` with the embedded default and the random-weight presets (``models``).

It may import io, cache and storage; the methods build on it, never the other way.
"""
