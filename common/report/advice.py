"""Capacity advice from a server's own view of its load: pure functions over the samples its
consumer records from /v1/loads. Advice names its evidence and never changes a server."""

from __future__ import annotations

import math
import os
from statistics import fmean, median
from typing import Any

# One sample: [unix time, running, max running, waiting, KV tokens used, KV pool, gen tok/s].
SAMPLE_FIELDS = ("t", "running", "max_running", "waiting", "used_tokens", "pool_tokens",
                 "gen_tps")
# The consumer samples every ~2.5 s; 144 samples are six minutes.
HISTORY_SAMPLES = 144
WINDOW_S = 120.0  # how long a condition must hold before it is advice, not noise
BUSY = 0.9  # mean running / max running at or above this: every slot is busy
KV_FREE = 0.5  # KV usage never above this: the pool has room for more requests
KV_FULL = 0.9  # median KV usage at or above this: the pool is the limit
KV_TARGET = 0.8  # the usage a suggested value aims for, leaving room for long answers
GROWTH = 2.0  # a running request is half way through its answer on average: it ends at ~2x
MAX_STEP = 2.5  # raise by at most this factor at a time: compute limits too; check, repeat
STALE_S = 30.0  # samples older than this at the window's end: the consumer is gone


def load_sample(t: float, load: dict[str, Any]) -> list[Any]:
    """A compact sample of a parsed /v1/loads answer (common.sglang.stream.parse_load)."""
    return [round(t, 1), load.get("num_reqs"), load.get("max_running_requests"),
            load.get("num_waiting_reqs"), load.get("num_used_tokens"),
            load.get("max_total_num_tokens"), load.get("gen_throughput")]


def as_dicts(history: list[Any] | None) -> list[dict[str, Any]]:
    """Samples as named fields, skipping any that are not the expected shape."""
    return [dict(zip(SAMPLE_FIELDS, s, strict=True)) for s in history or []
            if isinstance(s, list) and len(s) == len(SAMPLE_FIELDS)]


def window(samples: list[dict], now: float, window_s: float) -> list[dict]:
    """The samples covering the window, all under the capacity in force now; [] when they do not
    cover it."""
    if not samples or now - samples[-1]["t"] > STALE_S:
        return []
    current = samples[-1]["max_running"]
    recent: list[dict] = []
    for s in reversed(samples):
        if s["max_running"] != current:
            return []
        recent.append(s)
        if s["t"] <= now - window_s:
            recent.reverse()
            return recent if len(recent) >= 3 else []
    return []


def evidence(recent: list[dict]) -> dict[str, Any]:
    """The figures advice rests on, as a person would check them."""
    usage = [s["used_tokens"] / s["pool_tokens"] for s in recent
             if s["pool_tokens"] and s["used_tokens"] is not None]
    per_request = [s["used_tokens"] / s["running"] for s in recent
                   if s["running"] and s["used_tokens"] is not None]
    gen = [s["gen_tps"] for s in recent if s["gen_tps"] is not None]
    # What the server really runs when it has more than that to run.
    held_back = [s["running"] or 0 for s in recent if (s["waiting"] or 0) > 0]
    return {
        "window_s": round(recent[-1]["t"] - recent[0]["t"], 1), "samples": len(recent),
        "max_running": recent[-1]["max_running"],
        "running_mean": round(fmean(s["running"] or 0 for s in recent), 2),
        "waiting_mean": round(fmean(s["waiting"] or 0 for s in recent), 2),
        "waiting_max": max(s["waiting"] or 0 for s in recent),
        "running_while_waiting": round(fmean(held_back), 2) if held_back else None,
        "token_usage_max": round(max(usage), 4) if usage else None,
        "token_usage_median": round(median(usage), 4) if usage else None,
        "tokens_per_request_max": round(max(per_request)) if per_request else None,
        "max_total_num_tokens": recent[-1]["pool_tokens"],
        "gen_throughput_mean": round(fmean(gen), 1) if gen else None,
    }


def capacity_advice(server: str, history: list[Any] | None, now: float,
                    window_s: float = WINDOW_S) -> dict[str, Any] | None:
    """"raise" or "lower" --max-running-requests for one server, with its evidence; None when
    sized right or unknown."""
    recent = window(as_dicts(history), now, window_s)
    if not recent or not recent[-1]["max_running"]:
        return None
    ev = evidence(recent)
    cap = ev["max_running"]
    if ev["waiting_mean"] >= 1 or (ev["token_usage_median"] or 0) >= KV_FULL:
        return _lower(server, cap, ev)
    if (ev["running_mean"] >= BUSY * cap and ev["waiting_max"] == 0
            and ev["token_usage_max"] is not None and ev["token_usage_max"] <= KV_FREE):
        return _raise(server, cap, ev)
    return None


def _raise(server: str, cap: int, ev: dict[str, Any]) -> dict[str, Any] | None:
    # Requests the KV pool holds at KV_TARGET if each ends GROWTH times what it holds now.
    per_request, pool = ev["tokens_per_request_max"], ev["max_total_num_tokens"]
    bound = (max(1, math.floor(KV_TARGET * pool / (GROWTH * per_request)))
             if per_request and pool else None)
    suggested = min(bound or cap, math.ceil(cap * MAX_STEP))
    if suggested <= cap:
        return None
    message = (
        f"{server}: all {cap} slots busy for {ev['window_s']:.0f} s, nothing waiting, KV cache "
        f"at most {ev['token_usage_max']:.0%} used: raise --max-running-requests to "
        f"{suggested} (KV headroom allows ~{bound}; raise in steps, watch tok/s)")
    return _advice("raise", server, cap, suggested, message, ev)


def _lower(server: str, cap: int, ev: dict[str, Any]) -> dict[str, Any]:
    usage = ev["token_usage_median"] or 0
    if usage >= KV_FULL:
        suggested = max(1, math.floor(ev["running_mean"] * KV_TARGET / usage))
        why = f"KV cache {usage:.0%} used"
    else:
        suggested = max(1, math.floor(ev["running_while_waiting"] or ev["running_mean"]))
        why = f"{ev['waiting_mean']:g} requests waiting on average"
    suggested = min(suggested, cap - 1) if cap > 1 else None
    change = (f"lower --max-running-requests to {suggested}" if suggested
              else "do not raise --max-running-requests")
    runs = ev["running_while_waiting"] or ev["running_mean"]
    message = (f"{server}: {why} over {ev['window_s']:.0f} s while it runs "
               f"{runs:g} of {cap}: {change}")
    return _advice("lower", server, cap, suggested, message, ev)


def _advice(kind: str, server: str, cap: int, suggested: int | None, message: str,
            ev: dict[str, Any]) -> dict[str, Any]:
    return {"kind": kind, "server": server, "flag": "--max-running-requests",
            "current": cap, "suggested": suggested, "message": message, "evidence": ev}


def advice_alert(advice: dict[str, Any]) -> dict[str, Any]:
    """The advice as a monitor alert (logged once when it appears, once when it clears)."""
    command = (f"{advice['flag']} {advice['suggested']}" if advice["suggested"] else None)
    return {"kind": "capacity", "server": advice["server"], "message": advice["message"],
            "command": command}


def no_consumer_alert(run: str, queued: int, live_consumers: int) -> dict[str, Any] | None:
    """An alert while jobs wait and no consumer of the run is alive (a crash loop, consumers
    started under another run name or user): the figures alone would look merely idle."""
    if not queued or live_consumers:
        return None
    named = "" if run == "default" else f" --run {run}"
    return {"kind": "no_consumer",
            "message": (f"no consumer of run {run!r} is alive: {queued:,} jobs wait in the queue "
                        "and nothing takes them. Start one; if consumers run, read their logs: "
                        "one that exits at start (a crash loop, e.g. GENQ_USER cannot write "
                        "/out), or one started with another run name or Redis, never "
                        "heartbeats here"),
            "command": f"genq consume --server URL{named}"}


def annotate(servers: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """Give each status row its named samples and advice; return the advice. GENQ_ADVICE_WINDOW_S
    sets the window."""
    try:
        window_s = float(os.environ.get("GENQ_ADVICE_WINDOW_S") or WINDOW_S)
    except ValueError:
        window_s = WINDOW_S
    window_s = window_s if window_s > 0 else WINDOW_S
    for row in servers:
        history = row.pop("_history", None)
        row["load_history"] = as_dicts(history)
        row["advice"] = capacity_advice(row["server"], history, now, window_s)
    return [row["advice"] for row in servers if row["advice"]]
