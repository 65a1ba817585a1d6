"""The limits a speed grid searches: the longest prompt and the largest batch that fit a memory cap, by doubling and
then bisection on runs that fit or run out of memory."""

from __future__ import annotations

from collections.abc import Callable


def fits_memory(row: dict, max_memory: int | None) -> bool:
    return row["status"] == "ok" and (max_memory is None or row["peak_bytes"] <= max_memory)


def search_limit(try_size, start: int, limit: int, granularity: int) -> tuple[int | None, list[dict]]:
    """Largest size in [start, limit] for which ``try_size(size)`` returns a fitting row: doubling,
    then bisection to ``granularity``. Returns (size or None, every row tried)."""
    tried: list[dict] = []
    good, bad, size = None, None, start
    while size <= limit:
        row = try_size(size)
        tried.append(row)
        if row["fits"]:
            good, size = size, size * 2
        else:
            bad = size
            break
    if good is None:
        return None, tried
    if bad is None and good < limit:
        row = try_size(limit)
        tried.append(row)
        if row["fits"]:
            return limit, tried
        bad = limit
    while bad is not None and bad - good > granularity:
        middle = (good + bad) // 2 // granularity * granularity or good + granularity
        if middle <= good or middle >= bad:
            break
        row = try_size(middle)
        tried.append(row)
        good, bad = (middle, bad) if row["fits"] else (good, middle)
    return good, tried


def search_limits(
    fits: Callable[[str, str, int, int], dict],
    methods: list[str],
    max_context: bool,
    max_batch: bool,
    lengths: list[int],
    batches: list[int],
    context_limit: int,
    search_step: int,
    batch_limit: int,
) -> list[dict]:
    """Each method's longest prompt at the first batch size (``max_context``) and largest batch at the first length
    (``max_batch``), by ``search_limit`` over ``fits(kind, spec, length, batch)``."""
    limits = []
    for spec in methods:
        if max_context:
            size, tried = search_limit(
                lambda n: fits("max_context", spec, n, batches[0]), min(lengths), context_limit, search_step
            )
            limits.append({"method": spec, "kind": "max_context", "batch": batches[0], "value": size, "tried": tried})
        if max_batch:
            size, tried = search_limit(lambda b: fits("max_batch", spec, lengths[0], b), 1, batch_limit, 1)
            limits.append(
                {"method": spec, "kind": "max_batch", "prompt_tokens": lengths[0], "value": size, "tried": tried}
            )
    return limits
