"""Files: a cache's saved state (``saved``: the entries docs/file-format.md names, the model's fingerprint) and
the files shipped in PyPI wheels (``wheels``: the embedded model, RULER's data), fetched once.

It knows no method (a saved file names its method as plain values, which the generation layer turns back into
one): it may import cache and storage.
"""
