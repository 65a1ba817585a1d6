"""Storage, the bottom layer: the device's tensors and their layouts, knowing no cache layer, method or model.

It owns the slot layouts a cache layer holds (``slots``: dense buffers, a sliding window's ring, capped slots;
``packed``: per-head segments of different lengths), how kept tokens are written in 8, 6 or 4 bits or fp8
(``codec``), the chunks a sparse method offloads (``offload``), the attention kernels every layer calls
(``attention``), the fused custom ops and their Triton kernels (``ops``, ``kernels``), the CPU kernel that reads
coded tokens as they are (``cpu_kernels``, ``cpu_decode.cpp``), shape helpers and the clock every timing reads
(``tensors``). It may import torch (and Triton, on first use), nothing else of kvcompress.
"""
