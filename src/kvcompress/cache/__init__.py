"""The cache: a transformers ``Cache`` whose layers hold storage and apply a method's policy.

It owns ``KVCompressCache`` (``kv_cache``), its layers (``layer``: ``KVLayer``, transformers' layer contract with
``update`` and ``commit`` dispatched on the layer's ``phase``; ``WindowLayer`` for sliding-window layers), the ways a
prompt comes in (``intake``), what a layer holds beside its storage, declared once (``held``), a prompt's word spans
(``tokens``), and its two errors with the library's refusals that name their settings as data (``errors``: ``Said``).
It knows no method and no model: it may import storage only (and transformers' cache classes, which its layers and
cache subclass).
"""
