"""Storage, the bottom layer: the device's tensors and their layouts, knowing no cache layer, method or model.

It owns the slot layouts a cache layer holds (``slots``: dense buffers, a sliding window's ring, capped slots;
``packed``: per-head segments of different lengths), the chunks a sparse method offloads (``offload``), the
attention kernels every layer calls (``attention``), the fused custom ops and their Triton kernels (``ops``,
``kernels``) and shape helpers (``tensors``). It may import torch (and Triton, on first use), nothing else of
kvcompress.
"""
