"""The status as Prometheus text exposition (format 0.0.4), written by prometheus_client: its
format and escaping, over families built from one status."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
UP_HELP = "Whether the monitor can read the run's status."
LOADS = "its /v1/loads"


def _shipping(key: str):
    return lambda s: (s.get("shipping") or {}).get(key, 0)


def _load(key: str):
    """A figure the server reports about itself; None (NaN) when it does not."""
    return lambda v: (v.get("load") or {}).get(key)


# (name, type, help, the value from the status)
RUN_METRICS = [
    ("genq_status_up", "gauge", UP_HELP, lambda s: 1),
    ("genq_done_total", "counter", "Prompts whose latest result is written and acknowledged.",
     lambda s: s["done"]),
    ("genq_failed_total", "counter", "Prompts that ran out of attempts or are bad tasks.",
     lambda s: s["failed"]),
    ("genq_output_tokens_total", "counter", "Completion tokens over done results "
     "(every accepted generation of a --turns all run).",
     lambda s: s.get("output_tokens_total", 0)),
    ("genq_prompt_tokens_total", "counter", "Prompt tokens over done results "
     "(every accepted generation of a --turns all run).",
     lambda s: s.get("prompt_tokens_total", 0)),
    ("genq_cached_prompt_tokens_total", "counter",
     "Prompt tokens over done results the servers found in their prefix cache.",
     lambda s: s.get("cached_prompt_tokens_total", 0)),
    ("genq_generations_total", "counter", "Accepted generations: one a done prompt, or every "
     "accepted turn of a --turns all run's conversations.",
     lambda s: (s.get("conversations") or {}).get("generations", s["done"])),
    ("genq_shards_shipped_total", "counter", "Output shards shipped to S3 and verified.",
     _shipping("shards_shipped")),
    ("genq_shards_pending", "gauge", "Closed output shards still waiting to be shipped to S3.",
     _shipping("shards_pending")),
    ("genq_results_unshipped", "gauge", "Done results on a consumer's disk only, not yet in "
     "S3 (a dead consumer's last figure included).", _shipping("unshipped")),
    # Not genq_total: promtool rejects a _total suffix on anything but a counter.
    ("genq_prompts", "gauge", "Prompts in the data set.", lambda s: s["total"]),
    ("genq_remaining", "gauge", "Prompts neither done nor failed.", lambda s: s["remaining"]),
    ("genq_queued", "gauge", "Jobs waiting in the RQ queue.", lambda s: s["queued"]),
    ("genq_inflight", "gauge", "Jobs leased by consumers.", lambda s: s["inflight"]),
    ("genq_requests_per_second", "gauge", "Completions (generations) per second over 5 "
     "minutes.",
     lambda s: s["rate"]["req_per_s"]),
    ("genq_output_tokens_per_second", "gauge", "Output tokens per second over 5 minutes.",
     lambda s: s["rate"]["tok_per_s"]),
    ("genq_eta_seconds", "gauge", "Seconds until every prompt is done at the 5-minute rate.",
     lambda s: s["eta_s"]),
    ("genq_truncation_rate", "gauge", "Share of done results with finish_reason length.",
     lambda s: s["truncation_rate"]),
    ("genq_recent_truncation_rate", "gauge",
     "Share of the last 5 minutes' completions with finish_reason length.",
     lambda s: s["recent_truncation_rate"]),
    ("genq_params_version", "gauge", "Current generation parameter version.",
     lambda s: s["params_version"]),
    ("genq_version_truncation_rate", "gauge",
     "Share of the last hour's completions under the current parameters hitting max_tokens.",
     lambda s: (s.get("version_truncation") or {}).get("rate")),
    ("genq_alerts", "gauge", "Alerts the monitor raises now.", lambda s: len(s["alerts"])),
]

# Gauges, one sample per server: (name, help, the value from its status row)
SERVER_METRICS = [
    ("genq_server_inflight", "Jobs leased on the server.", lambda v: v["inflight"]),
    ("genq_server_requests_per_second", "Completions per second on the server over 5 minutes.",
     lambda v: v["req_per_s"]),
    ("genq_server_output_tokens_per_second",
     "Output tokens per second on the server over 5 minutes.", lambda v: v["tok_per_s"]),
    ("genq_server_capacity", "Concurrent requests the server's consumers keep in flight.",
     lambda v: v.get("capacity")),
    ("genq_server_running", f"Requests running on the server ({LOADS}).", _load("num_reqs")),
    ("genq_server_waiting", f"Requests queued inside the server ({LOADS}).",
     _load("num_waiting_reqs")),
    ("genq_server_max_running", "Requests the server runs at once, as its /v1/loads says.",
     _load("max_running_requests")),
    ("genq_server_kv_used_tokens", "KV-cache tokens held by the server's running requests.",
     _load("num_used_tokens")),
    ("genq_server_kv_pool_tokens", "KV-cache pool of the server in tokens (max_total_num_tokens).",
     _load("max_total_num_tokens")),
    ("genq_server_kv_usage", "Share of the server's KV-cache pool in use (0 to 1).",
     _load("token_usage")),
    ("genq_server_gen_tokens_per_second",
     "Output tokens per second the server reports decoding (gen_throughput).",
     _load("gen_throughput")),
    ("genq_server_advised_max_running",
     "The --max-running-requests the capacity advice suggests (NaN: no advice).",
     lambda v: (v.get("advice") or {}).get("suggested")),
]


class _Families(Collector):
    """The families of one status, for generate_latest (a registry would keep them)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def _family(name: str, kind: str, help_text: str, labels: list[str],
            samples: Iterable[tuple[list[str], float | int | None]]) -> Metric:
    """A metric family with one sample per (label values, value); None is NaN (not known)."""
    family_of = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    # A counter's name is given without _total: prometheus_client adds it to the samples.
    family = family_of(name.removesuffix("_total") if kind == "counter" else name, help_text,
                       labels=labels)
    for values, v in samples:
        family.add_metric(values, math.nan if v is None else v)
    return family


def _text(families: list[Metric]) -> str:
    return generate_latest(_Families(families)).decode()


def render(status: dict) -> str:
    """Every figure of the status as a metric family with HELP and TYPE lines."""
    run = status["run"]
    families = [_family(name, kind, help_text, ["run"], [([run], get(status))])
                for name, kind, help_text, get in RUN_METRICS]
    by_reason = ["run", "reason"]
    families += [
        _family("genq_finish_reason_total", "counter", "Done results by finish_reason.",
                by_reason, [([run, reason], count)
                            for reason, count in sorted(status["finish_reasons"].items())]),
        _family("genq_failed_by_reason", "gauge", "Failed prompts by reason (the most common few).",
                by_reason, [([run, row["reason"]], row["count"])
                            for row in status.get("failure_reasons", [])]),
        # A "quantile" label is reserved for summaries; these are exact, so a plain gauge family.
        _family("genq_output_tokens_percentile", "gauge",
                "Exact output-length percentiles of done results.", ["run", "percentile"],
                [([run, q], status["output_tokens"][key])
                 for key, q in (("p50", "50"), ("p90", "90"), ("p99", "99"), ("max", "100"))])]
    families += _conversations(run, status.get("conversations"))
    families += [_family(name, "gauge", help_text, ["run", "server"],
                         [([run, row["server"]], get(row)) for row in status["servers"]])
                 for name, help_text, get in SERVER_METRICS]
    return _text(families)


def _conversations(run: str, c: dict | None) -> list[Metric]:
    """A --turns all run's conversations by where they stand, and the done ones by how they
    ended (each `ended` value the run records)."""
    if not c:
        return []
    return [
        _family("genq_conversations", "gauge", "Conversations (--turns all) by state: done, "
                "being redone (a redo set their result aside), failed.", ["run", "state"],
                [([run, state], c.get(state, 0)) for state in ("done", "redoing", "failed")]),
        _family("genq_conversations_ended", "gauge", "Done conversations by how they ended.",
                ["run", "ended"], [([run, why], n) for why, n in sorted(c["stopped"].items())])]


def render_down(run: str, error: str) -> str:
    """What /metrics says while the status cannot be read: up 0, and why in a comment."""
    reason = " ".join(error.split())
    return f"# genq monitor cannot read run {run}: {reason}\n" + _text(
        [_family("genq_status_up", "gauge", UP_HELP, ["run"], [([run], 0)])])
