"""Suite-wide setup: under pytest-xdist (`make test` runs a worker per core) each worker takes its share of the
cores' threads, so two workers on two cores do not each start two threads and fight for them."""

from __future__ import annotations

import os

import torch

_WORKERS = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
if _WORKERS:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(_WORKERS)))
