"""The cache: a transformers ``Cache`` whose layers hold storage and apply a method's policy.

It owns ``KVCompressCache`` (``kv_cache``), its layers split by role (``layer``: transformers' layer contract as
a thin adapter over ``lifecycle``, the prompt's way from prefill to compression, and ``policy``, what a method's
layer overrides; ``window``: a sliding-window layer), what a layer holds while its prompt comes in (``intake``)
and a prompt's word spans (``tokens``). It knows no method and no model: it may import storage only.
"""
