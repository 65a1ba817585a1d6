"""Evaluation and benchmarks, kept outside the core: task generators, metrics, the accuracy runner, plots."""
