"""Where kvcompress meets the engines users run, one folder each: ``transformers`` (below the methods, which
attach to a model through it) and ``vllm`` (above them: it serves them). Nothing else touches either engine."""
