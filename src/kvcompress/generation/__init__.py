"""Generation: ``kvc.generate``, ``prefill``, ``compress`` and ``teacher_forced_logprobs`` (``generate``), the
decoding step compiled as one graph (``decode``) and the ``Result`` they return, a conversation over a cache
that saves to a file and loads back (``result``).

It may import methods, the transformers integration, io, cache and storage.
"""
