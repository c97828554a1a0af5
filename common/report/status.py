"""Where a run stands, read from Redis in two pipelines and derived with common.report.stats."""

from __future__ import annotations

import itertools
from collections import Counter
from functools import partial
from typing import Any, cast

import orjson
import redis

from genq.common.cli import run_keys
from genq.common.errors import UsageError, mask_tree
from genq.common.params import DEFAULTS, mask_raw
from genq.common.queue import bitmap, heartbeats
from genq.common.queue import run as runs
from genq.common.queue.keys import FINISH_NAMES, RATE_BUCKET_S, RunKeys
from genq.common.queue.replies import blob, text
from genq.common.report import advice, runhealth, stats
from genq.common.store.export_turns import figures as conversation_figures
from genq.common.task import row_fields

# The chart shows the last hour; the same buckets serve the 1/5/15-minute rates.
HISTORY_BUCKETS = 3600 // RATE_BUCKET_S
WINDOWS = {"1m": 60, "5m": 300, "15m": 900}
HISTORY_LIMIT = 20
TOP_REASONS = 5
REASONS_CAP = 20_000  # reasons of the first REASONS_CAP failed indices only: a bounded read


def _json(value: Any) -> Any:
    try:
        return orjson.loads(value) if value is not None else None
    except orjson.JSONDecodeError:
        return None


def _history(entry: Any) -> Any:
    """A parameter version's record as shown: version 1 records values, later ones [old, new]."""
    entry = _json(entry)
    if not isinstance(entry, dict) or not isinstance(entry.get("changes"), dict):
        return entry
    return {**entry, "changes": mask_raw(entry["changes"], pairs=entry.get("version", 1) > 1)}


def _number(value: Any) -> float | None:
    """A number genq wrote (a count, or a time in Unix seconds); None where there is none."""
    try:
        return float(text(value))
    except (TypeError, ValueError):
        return None


def _num(value: Any, default: float = 0) -> float:
    number = _number(value)
    return default if number is None else number


def _read(r: redis.Redis, k: RunKeys) -> dict[str, Any]:
    """Every per-run figure in one MULTI, so done, counters and histogram agree exactly."""
    p = r.pipeline(transaction=True)
    reads: dict[str, tuple[Any, ...]] = {  # (pipeline method, its arguments)
        "time": (p.time,), "meta": (p.hgetall, k.meta),
        "done": (p.bitcount, k.done), "failed": (p.bitcount, k.failed),
        "truncated": (p.bitcount, k.truncated), "queued": (p.llen, k.rq_queue),
        "inflight": (p.zcard, k.leases), "owners": (p.hvals, k.lease_owner),
        "counters": (p.hgetall, k.counters), "hist": (p.hgetall, k.length_hist),
        "version": (p.get, k.params_version), "params": (p.hgetall, k.params),
        "history": (p.lrange, k.params_history, -HISTORY_LIMIT, -1),
        "consumers": (partial(p.zrange, withscores=True), k.consumers, 0, -1),
        "outdirs": (p.smembers, k.outdirs), "ship": (p.hgetall, k.ship),
    }
    for call, *args in reads.values():
        call(*args)
    return dict(zip(reads, p.execute(), strict=True))


def _read_buckets(r: redis.Redis, k: RunKeys, now_bucket: int) -> dict:
    """The last hour of rate buckets, in one pipeline."""
    p = r.pipeline(transaction=False)
    span = range(now_bucket - HISTORY_BUCKETS, now_bucket + 1)
    for b in span:
        p.hgetall(k.rate_bucket(b))
    # Empty buckets are left out, so "was there activity" is a question of membership.
    return {b: {text(f): _num(v) for f, v in row.items()}
            for b, row in zip(span, p.execute(), strict=True) if row}


def _servers(raw: dict, buckets: dict, beats: dict, now: float, since: float | None) -> list:
    """One row per server: leases held, recent rates, and what its consumers report."""
    leased = Counter(text(o).split("|")[1] for o in raw["owners"] if text(o).count("|") >= 2)
    rows: dict[str, dict] = {}
    for name, seen in raw["consumers"]:
        beat = beats.get(text(name))
        if not beat or not beat.get("server"):
            continue  # heartbeat expired: the consumer is gone, its leases show it anyway
        row = rows.setdefault(beat["server"], {"capacity": 0, "consumers": [], "load": None,
                                               "running": 0, "claimed_ahead": 0})
        row["capacity"] += int(beat.get("capacity") or 0)
        row["running"] += int(beat.get("running") or 0)
        row["claimed_ahead"] += int(beat.get("ahead") or 0)
        row["consumers"].append(text(name))
        row["load"] = beat.get("load") or row["load"]
        row["_history"] = beat.get("load_history") or row.get("_history")
        row["last_seen_s"] = round(min(row.get("last_seen_s", 1e18), now - seen), 1)
        row["started_at"] = beat.get("started_at")
    first_seen: dict[str, float] = {}  # server -> start of its first bucket with a result
    for b in sorted(buckets):
        for field in buckets[b]:
            if field.startswith("req|"):
                first_seen.setdefault(field[4:], b * RATE_BUCKET_S)
    out = []
    for server in sorted(set(rows) | set(leased) | set(first_seen)):
        row = rows.get(server, {"capacity": None, "consumers": [], "load": None})
        rate = stats.rates(buckets, now, WINDOWS["5m"], since, suffix=f"|{server}")
        recent, _ = stats.window_sum(buckets, f"req|{server}", now, stats.STALL_S)
        known = [t for t in (first_seen.get(server), _number(row.get("started_at")), since)
                 if t is not None]
        # inflight: every lease on the server (a dead consumer's too, until it expires);
        # running: requests at the server now; claimed_ahead: leased, waiting for a slot.
        out.append({"server": server, "inflight": leased.get(server, 0), **rate,
                    "running": row.get("running"), "claimed_ahead": row.get("claimed_ahead"),
                    "capacity": row["capacity"], "load": row["load"],
                    "consumer": ",".join(row["consumers"]) or None,
                    "last_seen_s": row.get("last_seen_s"), "_history": row.get("_history"),
                    "_recent": recent, "_known_s": now - min(known) if known else 0.0})
    return out


def read_status(r: redis.Redis, run: str, *, truncation_threshold: float = 0.05) -> dict:
    """The run's figures as `genq status --json` shows them (CLI.md), plus monitor extras."""
    k = run_keys(run)
    raw = _read(r, k)
    if not raw["meta"]:
        raise UsageError(runhealth.missing_run_message(r, k))
    now = raw["time"][0] + raw["time"][1] / 1e6
    buckets = _read_buckets(r, k, int(now // RATE_BUCKET_S))
    beats = heartbeats.read(r, k, [text(name) for name, _ in raw["consumers"]])
    meta = {text(f): text(v) for f, v in raw["meta"].items()}
    every = (meta.get("turns") or runs.LAST) == runs.ALL
    if every:  # a request is a generation: the turns before each conversation's last count
        buckets = stats.every_generation(buckets)
    since = stats.activity_start(buckets, _number(meta.get("created_at")))
    status = _assemble(run, raw, buckets, beats, now, since, truncation_threshold, every)
    status["samples"] = samples = int(_num(meta.get("samples"), 1)) or 1
    status["turns"] = meta.get("turns") or runs.LAST  # a run setting, as samples is
    if every:  # what export writes, per conversation and generation
        status["conversations"] = conv = conversation_figures(r, k, status["total"])
        conv["generations_per_s"] = status["rate"]["req_per_s"]
    # Read just after the MULTI: a run of several samples pays one GET of its done bitmap.
    status["prompts_done"] = raw["done"] if samples == 1 else bitmap.full_groups(
        blob(r.get(k.done)), status["total"] // samples, samples)
    status["failure_reasons"], status["failure_reasons_counted"] = _failure_reasons(
        r, k, raw["failed"], samples)
    alert = runhealth.persistence_alert(r, k, sorted(text(d) for d in raw["outdirs"]))
    if alert:
        status["alerts"].append(alert)
    return cast(dict, mask_tree(status))  # no secrets in any field; still a dict


def _failure_reasons(r: redis.Redis, k: RunKeys, failed: int,
                     samples: int) -> tuple[list[dict], int]:
    """[{"reason", "count", "example_index"}] of the failed prompts (most common first; the
    example's row, and "example_sample" in a run of several samples), and how many were looked
    at."""
    bits = blob(r.get(k.failed)) if failed else b""
    indices = list(itertools.islice(bitmap.set_indices(bits), REASONS_CAP))
    kinds = runs.failure_reasons(r, k, indices)
    example: dict[str, int] = {}
    for index, kind in zip(indices, kinds, strict=True):
        example.setdefault(kind, index)
    return [{"reason": kind, "count": n, **{f"example_{key}": value for key, value in
                                            row_fields(example[kind], samples).items()}}
            for kind, n in Counter(kinds).most_common(TOP_REASONS)], len(indices)


def _shipping(raw: dict) -> dict | None:
    """Shards shipped (run totals) and pending (each consumer's backlog), the newest upload
    error; None if nothing was tried."""
    if not raw:
        return None
    ship = {text(f): text(v) for f, v in raw.items()}
    unshipped = {f[10:]: int(_num(v)) for f, v in ship.items() if f.startswith("unshipped|")}
    errors = sorted((_num(ship.get(f"error_at|{f[6:]}")), f[6:], v)
                    for f, v in ship.items() if f.startswith("error|"))
    return {
        "shards_shipped": int(_num(ship.get("shards"))),
        "bytes_shipped": int(_num(ship.get("bytes"))),
        "records_shipped": int(_num(ship.get("records"))),
        "shards_pending": sum(int(_num(v)) for f, v in ship.items() if f.startswith("pending|")),
        "bytes_pending": sum(int(_num(v)) for f, v in ship.items()
                             if f.startswith("pending_bytes|")),
        # done results on a consumer's disk only, a dead one's last figure included
        "unshipped": sum(unshipped.values()), "unshipped_by_consumer": unshipped,
        "last_error": f"{errors[-1][1]}: {errors[-1][2]}" if errors else None,
        "last_error_at": errors[-1][0] if errors else None,
    }


def _schema_counts(counters: dict[str, int]) -> dict[str, dict[str, int]]:
    """Per parameter version with a schema: answers that did not match it, prompts that failed
    on it (each of their answers invalid), and answers cut at max_tokens (not JSON); `unkept`,
    only once some: failed prompts whose answer Redis has no copy of (past its bound)."""
    names = {"invalid": "invalid", "schema_failed": "failed", "schema_cut": "cut",
             "schema_unkept": "unkept"}
    found: dict[str, dict[str, int]] = {}
    for field, n in counters.items():
        kind, _, version = field.partition("|")
        if kind in names:
            found.setdefault(version, {"invalid": 0, "failed": 0, "cut": 0})[names[kind]] = n
    return dict(sorted(found.items(), key=lambda item: int(item[0])))


def _every_turn(counters: dict[str, int]) -> dict[str, int]:
    """The counters with a `--turns all` run's made turns (turn.lua's made:*) added to its last
    turns' (ack.lua's): tokens and finish reasons of every generation, as export writes them."""
    out = dict(counters)
    for field, n in counters.items():
        if field.startswith("made:"):
            out[field[5:]] = out.get(field[5:], 0) + n
    return out


def _assemble(run: str, raw: dict, buckets: dict, beats: dict, now: float,
              since: float | None, threshold: float, every: bool = False) -> dict:
    meta = {text(f): text(v) for f, v in raw["meta"].items()}
    total, done, failed = int(_num(meta.get("total"))), raw["done"], raw["failed"]
    remaining = max(0, total - done - failed)
    counters = _every_turn({text(f): int(_num(v)) for f, v in raw["counters"].items()})
    hist = {int(_num(v)): int(_num(c)) for v, c in raw["hist"].items()}
    rates = {name: stats.rates(buckets, now, w, since) for name, w in WINDOWS.items()}
    if every:  # the ETA's pace: conversations done a second, not requests
        for name, w in WINDOWS.items():
            rates[name]["conversations_per_s"] = round(
                stats.window_rate(buckets, "conv", now, w, since), 4)
    pace = rates["5m"]["conversations_per_s" if every else "req_per_s"]
    # The parameters a consumer would run with right now (common.params.current's fallback).
    version = int(_num(raw["version"], 1)) or 1
    params = {text(v): _json(j) for v, j in raw["params"].items()}.get(str(version))
    params = params if isinstance(params, dict) else dict(DEFAULTS)
    recent, _ = stats.recent_truncation(buckets, now, since=since)
    servers = _servers(raw, buckets, beats, now, since)
    finish = {n: counters.get(f"finish:{n}", 0) for n in FINISH_NAMES.values()}
    # Judged on the current parameters' results only: right after raising max_tokens the old
    # limit's hits must not read as hits at the new one (and advise doubling it again).
    current, current_n = stats.recent_truncation(buckets, now, since=since, version=version)
    vt = stats.version_truncation(buckets, version)
    alert = stats.version_alert(vt, params.get("max_tokens"), run, threshold) or \
        stats.truncation_alert(current, current_n, params.get("max_tokens"), run, threshold)
    alerts = ([alert] if alert else []) + stats.stall_alerts(
        {s["server"]: s.pop("_recent") for s in servers},
        {s["server"]: s.pop("_known_s") for s in servers}, remaining)
    server_advice = advice.annotate(servers, now)
    alerts += [advice.advice_alert(a) for a in server_advice]
    if stranded := advice.no_consumer_alert(run, raw["queued"], len(beats)):
        alerts.append(stranded)
    return {
        "run": run, "total": total, "done": done, "queued": raw["queued"],
        "inflight": raw["inflight"], "failed": failed, "params_version": version,
        "running": sum(s["running"] or 0 for s in servers),
        "claimed_ahead": sum(s["claimed_ahead"] or 0 for s in servers),
        "finished": total > 0 and remaining == 0 and not raw["queued"] and not raw["inflight"],
        "rate": rates["5m"], "eta_s": stats.eta_seconds(remaining, pace),
        "finish_reasons": {n: c for n, c in finish.items() if c},
        "truncation_rate": stats.truncation_rate(finish["length"], done),
        "output_tokens": stats.percentiles(hist), "servers": servers, "remaining": remaining,
        "rates": rates, "recent_truncation_rate": recent, "version_truncation": vt,
        "truncated": raw["truncated"],
        # Done with a redo's set-aside result: the new attempt failed for good.
        "kept": counters.get("kept", 0),
        "output_tokens_total": counters.get("ctok_sum", 0),
        "prompt_tokens_total": counters.get("ptok_sum", 0),
        "cached_prompt_tokens_total": counters.get("cached_sum", 0),
        # Of the prompt tokens, those the servers found in their prefix cache (reported only
        # by servers launched with --enable-cache-report).
        "cache_hit_share": round(counters.get("cached_sum", 0) / counters["ptok_sum"], 4)
        if counters.get("ptok_sum") else None,
        # Per parameter version: answers `requeue --continue` continued, and their partials'
        # tokens, which regenerating them would have decoded again.
        "continued": {v.partition("|")[2]: {"continued": c, "decode_tokens_saved": counters.get(
            "saved|" + v.partition("|")[2], 0)} for v, c in counters.items()
            if v.startswith("continued|") and c > 0},
        "schema": _schema_counts(counters),
        "params": mask_raw(params), "params_history": [_history(h) for h in raw["history"]],
        "length_histogram": stats.histogram_bins(hist),
        "throughput": stats.throughput_series(buckets, int(now // RATE_BUCKET_S)),
        "dataset": meta.get("dataset"), "created_at": _number(meta.get("created_at")),
        "epoch": meta.get("epoch"), "recovered_at": _number(meta.get("recovered_at")),
        "alerts": alerts, "shipping": _shipping(raw["ship"]), "advice": server_advice,
        "time": round(now, 3),
    }
