"""The status as Prometheus text exposition (format 0.0.4), rendered by hand."""

from __future__ import annotations

import math

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

RUN_METRICS = [
    # (name, type, help, how to get the value from the status)
    ("genq_status_up", "gauge", "Whether the monitor can read the run's status.", lambda s: 1),
    (
        "genq_done_total",
        "counter",
        "Prompts whose latest result is written and acknowledged.",
        lambda s: s["done"],
    ),
    (
        "genq_failed_total",
        "counter",
        "Prompts that ran out of attempts or are bad tasks.",
        lambda s: s["failed"],
    ),
    (
        "genq_output_tokens_total",
        "counter",
        "Completion tokens over done results.",
        lambda s: s.get("output_tokens_total", 0),
    ),
    (
        "genq_shards_shipped_total",
        "counter",
        "Output shards shipped to S3 and verified.",
        lambda s: (s.get("shipping") or {}).get("shards_shipped", 0),
    ),
    (
        "genq_shards_pending",
        "gauge",
        "Closed output shards still waiting to be shipped to S3.",
        lambda s: (s.get("shipping") or {}).get("shards_pending", 0),
    ),
    # Not genq_total: promtool rejects a _total suffix on anything but a counter.
    ("genq_prompts", "gauge", "Prompts in the data set.", lambda s: s["total"]),
    ("genq_remaining", "gauge", "Prompts neither done nor failed.", lambda s: s["remaining"]),
    ("genq_queued", "gauge", "Jobs waiting in the RQ queue.", lambda s: s["queued"]),
    ("genq_inflight", "gauge", "Jobs leased by consumers.", lambda s: s["inflight"]),
    (
        "genq_requests_per_second",
        "gauge",
        "Completions per second over 5 minutes.",
        lambda s: s["rate"]["req_per_s"],
    ),
    (
        "genq_output_tokens_per_second",
        "gauge",
        "Output tokens per second over 5 minutes.",
        lambda s: s["rate"]["tok_per_s"],
    ),
    (
        "genq_eta_seconds",
        "gauge",
        "Seconds until every prompt is done at the 5-minute rate.",
        lambda s: s["eta_s"],
    ),
    (
        "genq_truncation_rate",
        "gauge",
        "Share of done results with finish_reason length.",
        lambda s: s["truncation_rate"],
    ),
    (
        "genq_recent_truncation_rate",
        "gauge",
        "Share of the last 5 minutes' completions with finish_reason length.",
        lambda s: s["recent_truncation_rate"],
    ),
    (
        "genq_params_version",
        "gauge",
        "Current generation parameter version.",
        lambda s: s["params_version"],
    ),
    (
        "genq_version_truncation_rate",
        "gauge",
        "Share of the last hour's completions under the current parameters hitting max_tokens.",
        lambda s: (s.get("version_truncation") or {}).get("rate"),
    ),
    ("genq_alerts", "gauge", "Alerts the monitor raises now.", lambda s: len(s["alerts"])),
]

SERVER_METRICS = [
    ("genq_server_inflight", "Jobs leased on the server.", lambda v: v["inflight"]),
    (
        "genq_server_requests_per_second",
        "Completions per second on the server over 5 minutes.",
        lambda v: v["req_per_s"],
    ),
    (
        "genq_server_output_tokens_per_second",
        "Output tokens per second on the server over 5 minutes.",
        lambda v: v["tok_per_s"],
    ),
    (
        "genq_server_capacity",
        "Concurrent requests the server's consumers keep in flight.",
        lambda v: v.get("capacity"),
    ),
    (
        "genq_server_running",
        "Requests running on the server (its /v1/loads, or /get_load before SGLang 0.5).",
        lambda v: (v.get("load") or {}).get("num_reqs"),
    ),
    (
        "genq_server_waiting",
        "Requests queued inside the server (its /v1/loads, or /get_load before SGLang 0.5).",
        lambda v: (v.get("load") or {}).get("num_waiting_reqs"),
    ),
    (
        "genq_server_max_running",
        "Requests the server runs at once, as its /v1/loads says.",
        lambda v: (v.get("load") or {}).get("max_running_requests"),
    ),
    (
        "genq_server_kv_used_tokens",
        "KV-cache tokens held by the server's running requests.",
        lambda v: (v.get("load") or {}).get("num_used_tokens"),
    ),
    (
        "genq_server_kv_pool_tokens",
        "KV-cache pool of the server in tokens (max_total_num_tokens).",
        lambda v: (v.get("load") or {}).get("max_total_num_tokens"),
    ),
    (
        "genq_server_kv_usage",
        "Share of the server's KV-cache pool in use (0 to 1).",
        lambda v: (v.get("load") or {}).get("token_usage"),
    ),
    (
        "genq_server_gen_tokens_per_second",
        "Output tokens per second the server reports decoding (gen_throughput).",
        lambda v: (v.get("load") or {}).get("gen_throughput"),
    ),
    (
        "genq_server_advised_max_running",
        "The --max-running-requests the capacity advice suggests (NaN: no advice).",
        lambda v: (v.get("advice") or {}).get("suggested"),
    ),
]


def escape_label(value: str) -> str:
    """Label values escape backslash, double quote and newline, per the exposition format."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value(v: float | int | None) -> str:
    if v is None:
        return "NaN"
    f = float(v)
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    return str(int(f)) if f.is_integer() and abs(f) < 2**53 else repr(f)


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items()) + "}"


def render(status: dict) -> str:
    """Every figure of the status as a metric family with HELP and TYPE lines."""
    run = _labels(run=status["run"])
    lines: list[str] = []
    for name, kind, help_text, get in RUN_METRICS:
        lines += [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} {kind}",
            f"{name}{run} {_value(get(status))}",
        ]
    lines += [
        "# HELP genq_finish_reason_total Done results by finish_reason.",
        "# TYPE genq_finish_reason_total counter",
    ]
    for reason, count in sorted(status["finish_reasons"].items()):
        lines.append(
            f"genq_finish_reason_total{_labels(run=status['run'], reason=reason)} {_value(count)}"
        )
    lines += [
        "# HELP genq_failed_by_reason Failed prompts by reason (the most common few).",
        "# TYPE genq_failed_by_reason gauge",
    ]
    for row in status.get("failure_reasons", []):
        lines.append(f"genq_failed_by_reason{_labels(run=status['run'], reason=row['reason'])} "
                     f"{_value(row['count'])}")
    # A "quantile" label is reserved for summaries; these are exact, so a plain gauge family.
    lines += [
        "# HELP genq_output_tokens_percentile Exact output-length percentiles of done results.",
        "# TYPE genq_output_tokens_percentile gauge",
    ]
    for key, q in (("p50", "50"), ("p90", "90"), ("p99", "99"), ("max", "100")):
        lines.append(
            f"genq_output_tokens_percentile{_labels(run=status['run'], percentile=q)} "
            f"{_value(status['output_tokens'][key])}"
        )
    for name, help_text, get in SERVER_METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for row in status["servers"]:
            labels = _labels(run=status["run"], server=row["server"])
            lines.append(f"{name}{labels} {_value(get(row))}")
    return "\n".join(lines) + "\n"


def render_down(run: str, error: str) -> str:
    """What /metrics says while the status cannot be read: up 0, and why in a comment."""
    reason = " ".join(error.split())
    return (
        f"# genq monitor cannot read run {run}: {reason}\n"
        "# HELP genq_status_up Whether the monitor can read the run's status.\n"
        "# TYPE genq_status_up gauge\n"
        f"genq_status_up{_labels(run=run)} 0\n"
    )
