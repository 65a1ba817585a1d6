"""Evaluation and benchmarks, kept outside the core: task generators, metrics, the accuracy runner, the speed grid,
the papers' headline and observations, plots.

It may import every layer below the front (generation, vLLM's serving, methods, integrations, io, cache, storage).
"""
