"""Rate, ETA, percentile, confidence and alert maths over the figures genq keeps; no I/O."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from itertools import accumulate
from typing import Any

from genq.common.queue.keys import RATE_BUCKET_S

Buckets = Mapping[int, Mapping[str, float]]

TRUNCATION_THRESHOLD = 0.05
# Below this many recent completions a truncation share is noise (1 of 3 is not "33 %").
TRUNCATION_MIN_SAMPLES = 20
RECENT_S = 300
STALL_S = 300
Z95 = 1.959964  # two-sided 95 %


def activity_start(buckets: Buckets, created_at: float | None = None) -> float | None:
    """When the run began producing results: its first bucket with completions, or its creation
    time within it."""
    active = [b for b, f in buckets.items() if f.get("req", 0) > 0 or f.get("gen", 0) > 0]
    if not active:
        return created_at
    first = min(active) * RATE_BUCKET_S
    if created_at is not None and first <= created_at < first + RATE_BUCKET_S:
        return created_at
    return float(first)


def window_sum(buckets: Buckets, field: str, now: float, window_s: float,
               since: float | None = None) -> tuple[float, float]:
    """Sum of ``field`` over [max(now - window_s, since), now], and that span in s; a bucket
    partly inside counts in proportion, so the rate slides smoothly."""
    since = min(since, now) if since is not None else None
    start = now - window_s if since is None else max(now - window_s, since)
    total = 0.0
    for bucket, fields in buckets.items():
        lo = bucket * RATE_BUCKET_S
        hi = min(lo + RATE_BUCKET_S, now)
        if hi <= start or lo > now:
            continue
        value = fields.get(field, 0)
        # Nothing happened before the run began, so a bucket's events spread over its active
        # part only; only that part's share inside the window counts.
        active_lo = lo if since is None else max(lo, since)
        if start > active_lo:
            value *= (hi - start) / (hi - active_lo)
        total += value
    return total, now - start


def window_rate(buckets: Buckets, field: str, now: float, window_s: float,
                since: float | None = None) -> float:
    """Events of ``field`` per second over the window; 0 under one second of history."""
    total, covered = window_sum(buckets, field, now, window_s, since)
    return total / covered if covered >= 1.0 else 0.0


def rates(buckets: Buckets, now: float, window_s: float, since: float | None = None,
          suffix: str = "") -> dict[str, float]:
    """{req_per_s, tok_per_s} over the window; ``suffix`` selects a server (``"|<server>"``)."""
    return {"req_per_s": round(window_rate(buckets, "req" + suffix, now, window_s, since), 4),
            "tok_per_s": round(window_rate(buckets, "tok" + suffix, now, window_s, since), 2)}


def every_generation(buckets: Buckets) -> dict[int, dict[str, float]]:
    """A `--turns all` run's buckets with every generation a request: ack.lua's `req` (the
    conversations' last turns, kept as `conv`, the ETA's pace) plus turn.lua's `gen` (the turns
    before them), the run's and each server's (`gen|<server>`)."""
    out: dict[int, dict[str, float]] = {}
    for bucket, fields in buckets.items():
        row = dict(fields)
        row["conv"] = fields.get("req", 0)
        for field, n in fields.items():
            if field == "gen" or field.startswith("gen|"):
                key = "req" + field[3:]
                row[key] = row.get(key, 0) + n
        out[bucket] = row
    return out


def eta_seconds(remaining: int, req_per_s: float) -> float | None:
    """Seconds until ``remaining`` prompts are done at ``req_per_s``; None without a rate."""
    if remaining <= 0:
        return 0.0
    if req_per_s <= 0:
        return None
    return round(remaining / req_per_s, 1)


def percentiles(hist: Mapping[int, int]) -> dict[str, float | int | None]:
    """Exact mean, p50, p90, p99 and max (nearest-rank) of a value -> count histogram."""
    items = sorted((v, c) for v, c in hist.items() if c > 0)
    n = sum(c for _, c in items)
    if n == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    out: dict[str, float | int | None] = {"mean": round(sum(v * c for v, c in items) / n, 1)}
    at_or_below = list(accumulate(c for _, c in items))
    for name, q in (("p50", 0.50), ("p90", 0.90), ("p99", 0.99)):
        # Nearest rank: the smallest value with at least ceil(q * n) results at or below it.
        rank = max(1, math.ceil(q * n - 1e-9))
        out[name] = items[bisect.bisect_left(at_or_below, rank)][0]
    out["max"] = items[-1][0]
    return out


def histogram_bins(hist: Mapping[int, int], bins: int = 20) -> list[dict[str, int]]:
    """Equal-width bins [lo, hi) from 0 to past the max value, for a length chart."""
    values = [v for v, c in hist.items() if c > 0]
    if not values:
        return []
    width = max(1, math.ceil((max(values) + 1) / bins))
    out = [{"lo": i * width, "hi": (i + 1) * width, "count": 0} for i in range(bins)]
    for v, c in hist.items():
        if c > 0:
            out[min(max(v, 0) // width, bins - 1)]["count"] += c
    # Trailing empty bins only exist when the width rounded up; they carry no information.
    while out and out[-1]["count"] == 0:
        out.pop()
    return out


def truncation_rate(length: int, done: int) -> float:
    """Share of done results that ended with finish_reason length."""
    return round(length / done, 4) if done > 0 else 0.0


def recent_truncation(buckets: Buckets, now: float, since: float | None = None,
                      version: int | None = None) -> tuple[float, float]:
    """(truncated share of the last RECENT_S s's completions, their number), of `version`."""
    length_field, req_field = ("fin|length", "req") if version is None else (
        f"vlen|{version}", f"vreq|{version}")
    length, _ = window_sum(buckets, length_field, now, RECENT_S, since)
    req, _ = window_sum(buckets, req_field, now, RECENT_S, since)
    return (round(length / req, 4) if req > 0 else 0.0), req


def throughput_series(buckets: Buckets, now_bucket: int, points: int = 60,
                      group: int = 6) -> list[dict[str, float]]:
    """Per-``group``-bucket rates ending before the (incomplete) current bucket, oldest first."""
    out = []
    span = group * RATE_BUCKET_S
    for p in range(points, 0, -1):
        first = now_bucket - p * group
        req = sum(buckets.get(b, {}).get("req", 0) for b in range(first, first + group))
        tok = sum(buckets.get(b, {}).get("tok", 0) for b in range(first, first + group))
        out.append({"t": first * RATE_BUCKET_S, "req_per_s": round(req / span, 4),
                    "tok_per_s": round(tok / span, 2)})
    return out


def _truncation(finding: str, max_tokens: int | None, run: str, threshold: float) -> dict:
    """A truncation alert (`finding` names the {limit}), with the command that redoes the
    truncated prompts at twice the limit where it is known."""
    limit = f"max_tokens={max_tokens}" if max_tokens else "max_tokens"
    alert: dict = {"kind": "truncation", "message": finding.format(limit=limit) + (
        f" (threshold {threshold:.0%}); raise it and redo the truncated ones")}
    if max_tokens:
        # Pasted as is, the command must act on this run, not on whatever GENQ_RUN says.
        alert["command"] = (f"genq requeue --set max_tokens={2 * int(max_tokens)} --redo "
                            "truncated" + ("" if run == "default" else f" --run {run}"))
    return alert


def truncation_alert(recent_rate: float, samples: float, max_tokens: int | None, run: str,
                     threshold: float = TRUNCATION_THRESHOLD) -> dict | None:
    """An alert when recent completions hit max_tokens more often than ``threshold``."""
    if samples < TRUNCATION_MIN_SAMPLES or recent_rate <= threshold:
        return None
    return _truncation(f"{recent_rate:.0%} of completions in the last {RECENT_S // 60} min hit "
                       "{limit}", max_tokens, run, threshold)


def wilson(k: int, n: int) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials: honest at small n and near 0 or 1."""
    if n <= 0:
        return 0.0, 1.0
    p, z = k / n, Z95
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def version_truncation(buckets: Buckets, version: int) -> dict[str, Any]:
    """Is the new limit enough? `version`'s completions and truncations in the last hour, with a
    Wilson interval."""
    n = int(sum(b.get(f"vreq|{version}", 0) for b in buckets.values()))
    k = int(sum(b.get(f"vlen|{version}", 0) for b in buckets.values()))
    low, high = wilson(k, n)
    return {"version": version, "completions": n, "truncated": k,
            "rate": round(k / n, 4) if n else None,
            "ci": [round(low, 4), round(high, 4)] if n else None}


def version_alert(vt: dict[str, Any], max_tokens: int | None, run: str,
                  threshold: float) -> dict | None:
    """After a pivot: the new version's own truncation rate, if still above the threshold."""
    if (vt["version"] <= 1 or vt["completions"] < TRUNCATION_MIN_SAMPLES
            or vt["rate"] <= threshold):
        return None
    low, high = vt["ci"]
    return _truncation(f"{vt['rate']:.0%} (95% CI {low:.0%}-{high:.0%}) of the "
                       f"{vt['completions']} completions under v{vt['version']} ({{limit}}) "
                       "still hit the limit", max_tokens, run, threshold)


def stall_alerts(recent_req: Mapping[str, float], known_for_s: Mapping[str, float],
                 remaining: int) -> list[dict]:
    """Alerts for servers known STALL_S s without a completion in that long, while work remains."""
    if remaining <= 0:
        return []
    return [{"kind": "stalled_server", "server": server,
             "message": f"{server} completed nothing in the last {STALL_S / 60:g} min while "
                        f"{remaining} prompts remain; check the server and its consumer"}
            for server in sorted(recent_req)
            if recent_req[server] <= 0 and known_for_s.get(server, 0.0) >= STALL_S]
