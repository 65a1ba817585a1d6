"""What a speed run's measurements become: a decoding step's figures against the bandwidth bound, the median over
repeats, and the peak memory's growth per prompt token."""

from __future__ import annotations

import statistics

from transformers import PreTrainedModel

from ..storage import kernel_choice
from .audit import StepAudit
from .device import peak_bytes


def decode_figures(
    model: PreTrainedModel,
    stats: dict,
    times: list[float],
    prefill_ms: float,
    batch: int,
    bandwidth: float,
    audit: StepAudit,
) -> dict:
    """A run's figures from its timed steps (``times``, ms) and its cache's ``stats``: speed, memory, bytes read
    per step against the machine's bandwidth, and the step's ops."""
    decode_ms = statistics.median(times)
    read = weight_bytes(model) + stats["bytes_read_per_step"]
    return dict(
        prefill_s=prefill_ms / 1000,
        compress_share=stats["compress_s"] / (prefill_ms / 1000),
        **step_figures(decode_ms, batch, read, bandwidth),
        kv_device_bytes=stats["device_bytes"],
        kv_full_bytes=stats["kv_bytes_full"],
        offloaded_bytes=stats["offloaded_bytes"],
        peak_bytes=peak_bytes(model.device),
        held_bytes=weight_bytes(model) + stats["device_bytes"],
        bytes_read_per_step=read,
        bound_ms_per_token=read / bandwidth * 1000,
        ops_per_step=audit.total,
        host_reads_per_step=sum(audit.host_reads.values()),
        sdpa=kernel_choice.sdpa_choices(),
        sdpa_graphed=kernel_choice.sdpa_choices(graphed=True),
    )


def step_figures(decode_ms: float, batch: int, read: int, bandwidth: float) -> dict:
    """What follows from a decoding step's time: tokens per second, and the bandwidth its ``read`` bytes took."""
    return dict(
        decode_ms_per_token=decode_ms,
        tokens_per_s=batch * 1000 / decode_ms,
        achieved_bandwidth=read / (decode_ms / 1000),
        bandwidth_fraction=read / (decode_ms / 1000) / bandwidth,
    )


def with_repeats(rows: list[dict], bandwidth: float) -> dict:
    """One run's row from its repeats: the first's figures, its step time the median of theirs (each repeat's in
    ``decode_ms_runs``), and the speed figures that follow from it."""
    row = dict(rows[0])
    times = [r["decode_ms_per_token"] for r in rows if r["status"] == "ok"]
    if len(rows) == 1 or len(times) < len(rows):
        return row
    row.update(
        decode_ms_runs=times,
        **step_figures(statistics.median(times), row["batch"], row["bytes_read_per_step"], bandwidth),
    )
    return row


def hidden_vector_bytes(model: PreTrainedModel) -> int:
    """Bytes of one token's hidden state: the unit a prefill's memory per prompt token is counted in."""
    return model.config.get_text_config().hidden_size * next(model.parameters()).element_size()


def peak_slopes(rows: list[dict], vector_bytes: int) -> list[dict]:
    """Per method and batch with two or more prompt lengths: how the peak grows per prompt token
    between the shortest and the longest that ran, in bytes and in hidden-sized vectors."""
    slopes = []
    for method, batch in dict.fromkeys((r["method"], r["batch"]) for r in rows):
        ok = sorted(
            (r["prompt_tokens"], r["peak_bytes"])
            for r in rows
            if r["method"] == method and r["batch"] == batch and r["status"] == "ok"
        )
        if len(ok) >= 2 and ok[-1][0] > ok[0][0]:
            per_token = (ok[-1][1] - ok[0][1]) / ((ok[-1][0] - ok[0][0]) * batch)
            slopes.append(
                {
                    "method": method,
                    "batch": batch,
                    "from_tokens": ok[0][0],
                    "to_tokens": ok[-1][0],
                    "bytes_per_token": per_token,
                    "hidden_vectors_per_token": per_token / vector_bytes,
                }
            )
    return slopes


def weight_bytes(model: PreTrainedModel) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
