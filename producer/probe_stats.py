"""What a probe's answers say about a pivot, as pure functions: the truncation rate at the new
limit with a Wilson interval, the new lengths, and what the whole redo will cost."""

from __future__ import annotations

import math
from statistics import fmean
from typing import Any

from common.report.confidence import wilson


def percentile(values: list[int], q: float) -> int | None:
    """Nearest-rank percentile (the value itself, never interpolated), like genq status."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(new: list[tuple[int, str | None]], old_tokens: list[int], *, population: int,
              remaining: int, remaining_mean: float, tok_per_s: float, servers: int,
              ) -> dict[str, Any]:
    """new: (completion_tokens, finish_reason) per probed prompt; old_tokens: what those
    prompts' current results hold; population: prompts the redo would run again; remaining:
    prompts not done yet, expected at remaining_mean tokens each; tok_per_s: the run's output
    rate; servers: GPUs sharing it."""
    n = len(new)
    lengths = [t for t, _ in new]
    truncated = sum(1 for _, f in new if f == "length")
    low, high = wilson(truncated, n)
    mean_new = fmean(lengths) if lengths else 0.0
    mean_old = fmean(old_tokens) if old_tokens else 0.0
    # The probed prompts are already answered and are reused: the redo runs the rest.
    redo_tokens = max(0, population - n) * mean_new
    left = remaining * remaining_mean + redo_tokens
    per_gpu = tok_per_s / servers if servers else 0.0
    return {
        "probe_n": n,
        "population": population,
        "truncated": truncated,
        "truncation_rate": round(truncated / n, 4) if n else None,
        "truncation_ci": [round(low, 4), round(high, 4)],
        "length_mean": round(mean_new, 1),
        "length_p50": percentile(lengths, 50),
        "length_p90": percentile(lengths, 90),
        "length_p99": percentile(lengths, 99),
        "old_length_mean": round(mean_old, 1),
        "extra_tokens": round(population * (mean_new - mean_old)),
        "redo_tokens": round(redo_tokens),
        "gpu_s": round(redo_tokens / per_gpu, 1) if per_gpu else None,
        "eta_s": round(left / tok_per_s, 1) if tok_per_s else None,
        "tok_per_s": round(tok_per_s, 1),
    }
