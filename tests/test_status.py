"""read_status against a real Redis: every figure from keys written per the contract."""

from __future__ import annotations

import orjson
import pytest
import redis
from pipeline import queue_jobs, record_failure, take_leases
from rich.console import Console

from genq.common.errors import UsageError
from genq.common.queue.keys import RATE_BUCKET_S as B
from genq.common.queue.keys import RunKeys
from genq.common.report.status import read_status
from genq.common.report.status_table import human_duration, render_table

A, Bsrv = "http://gpu0:30000", "http://gpu1:30000"


def redis_now(r: redis.Redis) -> float:
    sec, usec = r.time()
    return sec + usec / 1e6


def populate(
    r: redis.Redis,
    run: str,
    *,
    total: int = 1000,
    history_s: int = 1800,
    req_per_bucket: int = 20,
    length_per_bucket: int = 1,
    created_at=None,
    max_tokens: int = 4096,
) -> float:
    """A run with 100 done (17 truncated), 3 failed, steady buckets; returns Redis now."""
    k = RunKeys(run)
    now = redis_now(r)
    nb = int(now // B)
    r.hset(
        k.meta,
        mapping={
            "total": total,
            "dataset": "/d.jsonl",
            "fingerprint": "f",
            "created_at": created_at if created_at is not None else now - 86400,
        },
    )
    for i in range(100):
        r.setbit(k.done, i, 1)
    for i in range(100, 117):
        r.setbit(k.truncated, i - 100, 1)
    for i in (500, 501, 502):
        r.setbit(k.failed, i, 1)
    r.set(k.params_version, 2)
    take_leases(r, run, [700, 701, 702], A)  # leases as claim.lua writes them
    take_leases(r, run, [703, 704], Bsrv)
    queue_jobs(r, run, list(range(600, 612)))
    r.hset(
        k.counters,
        mapping={
            "finish:stop": 83,
            "finish:length": 17,
            "finish:abort": 0,
            "ctok_sum": 83 * 1000 + 17 * 4096,
            "ptok_sum": 5000,
        },
    )
    r.hset(k.length_hist, mapping={"1000": 83, "4096": 17})
    r.set(k.params_version, 2)
    r.hset(
        k.params,
        mapping={
            "1": orjson.dumps({"max_tokens": 2048}),
            "2": orjson.dumps({"max_tokens": max_tokens, "temperature": 0.6}),
        },
    )
    r.rpush(
        k.params_history,
        orjson.dumps(
            {"version": 1, "changes": {}, "redo": "none", "inflight": "finish", "at": now - 3600}
        ),
        orjson.dumps(
            {
                "version": 2,
                "changes": {"max_tokens": max_tokens},
                "redo": "truncated",
                "inflight": "finish",
                "at": now - 60,
            }
        ),
    )
    # Complete buckets only; the current bucket stays empty, so rates are exact to compute.
    for b in range(nb - history_s // B, nb):
        r.hset(
            k.rate_bucket(b),
            mapping={
                "req": req_per_bucket,
                "tok": req_per_bucket * 100,
                f"req|{A}": req_per_bucket * 3 // 4,
                f"tok|{A}": req_per_bucket * 75,
                f"req|{Bsrv}": req_per_bucket // 4,
                f"tok|{Bsrv}": req_per_bucket * 25,
                "fin|stop": req_per_bucket - length_per_bucket,
                "fin|length": length_per_bucket,
                # All under the current version 2 (the alert judges only those).
                "vreq|2": req_per_bucket,
                "vlen|2": length_per_bucket,
            },
        )
    r.zadd(k.consumers, {"c-a": now - 2, "c-b": now - 4})
    r.set(
        k.consumer("c-a"),
        orjson.dumps(
            {
                "name": "c-a",
                "server": A,
                "capacity": 40,
                "inflight": 3,
                "running": 2,
                "ahead": 1,
                "load": {"num_reqs": 38, "num_waiting_reqs": 1},
                "host": "h",
                "pid": 1,
            }
        ),
    )
    r.set(
        k.consumer("c-b"),
        orjson.dumps(
            {
                "name": "c-b",
                "server": Bsrv,
                "capacity": 16,
                "inflight": 2,
                "load": None,
                "host": "h",
                "pid": 2,
            }
        ),
    )
    return now


def covered_fraction(status: dict, window: float, populated: float) -> float:
    """The share of a window that has data: populate() fills the buckets before the one it ran
    in, `populated` (its Redis time); from that bucket on, up to the status's time, nothing. The
    status may be read in a later bucket than populate() ran in (CI saw one 10 s boundary pass)."""
    return (window - (status["time"] - (populated // B) * B)) / window


def test_every_figure(r, run_name):
    populated = populate(r, run_name)
    s = read_status(r, run_name)
    assert {
        k: s[k]
        for k in (
            "run",
            "total",
            "done",
            "queued",
            "inflight",
            "failed",
            "params_version",
            "remaining",
        )
    } == {
        "run": run_name,
        "total": 1000,
        "done": 100,
        "queued": 12,
        "inflight": 5,
        "failed": 3,
        "params_version": 2,
        "remaining": 897,
    }
    f = covered_fraction(s, 300, populated)
    assert s["rate"] == {
        "req_per_s": pytest.approx(2.0 * f, abs=1e-3),
        "tok_per_s": pytest.approx(200.0 * f, abs=0.01),
    }
    assert s["rates"]["5m"] == s["rate"]
    for window, seconds in (("1m", 60), ("15m", 900)):
        assert s["rates"][window]["req_per_s"] == pytest.approx(
            2.0 * covered_fraction(s, seconds, populated), abs=1e-3)
    assert s["eta_s"] == pytest.approx(897 / s["rate"]["req_per_s"], rel=1e-3)
    assert s["finish_reasons"] == {"stop": 83, "length": 17}  # zero entries omitted
    assert s["truncation_rate"] == 0.17
    assert s["recent_truncation_rate"] == pytest.approx(0.05)
    assert s["output_tokens"] == {
        "mean": round((83 * 1000 + 17 * 4096) / 100, 1),
        "p50": 1000,
        "p90": 4096,
        "p99": 4096,
        "max": 4096,
    }
    assert s["output_tokens_total"] == 83 * 1000 + 17 * 4096
    assert sum(b["count"] for b in s["length_histogram"]) == 100
    assert s["params"] == {"max_tokens": 4096, "temperature": 0.6}
    assert [h["version"] for h in s["params_history"]] == [1, 2]
    assert s["alerts"] == []  # 5 % recent truncation is not above the 5 % threshold
    assert s["time"] == pytest.approx(redis_now(r), abs=5)


def test_servers(r, run_name):
    populated = populate(r, run_name)
    s = read_status(r, run_name)
    by = {row["server"]: row for row in s["servers"]}
    assert list(by) == [A, Bsrv]
    f = covered_fraction(s, 300, populated)
    assert by[A]["inflight"] == 3 and by[Bsrv]["inflight"] == 2
    assert by[A]["req_per_s"] == pytest.approx(1.5 * f, abs=1e-3)
    assert by[A]["tok_per_s"] == pytest.approx(150.0 * f, abs=0.01)
    assert by[Bsrv]["req_per_s"] == pytest.approx(0.5 * f, abs=1e-3)
    assert by[A]["capacity"] == 40 and by[Bsrv]["capacity"] == 16
    assert by[A]["load"] == {"num_reqs": 38, "num_waiting_reqs": 1}
    assert by[Bsrv]["load"] is None
    assert by[A]["consumer"] == "c-a"
    assert by[A]["last_seen_s"] == pytest.approx(2, abs=2)
    assert set(by[A]) >= {"server", "inflight", "req_per_s", "tok_per_s"}


def test_truncation_alert_names_the_fix(r, run_name):
    populate(r, run_name, length_per_bucket=4, max_tokens=4096)
    s = read_status(r, run_name)
    assert s["recent_truncation_rate"] == pytest.approx(0.2)
    [alert] = s["alerts"]
    assert alert["kind"] == "truncation"
    assert alert["command"] == (
        f"genq requeue --set max_tokens=8192 --redo truncated --run {run_name}"
    )
    assert read_status(r, run_name, truncation_threshold=0.25)["alerts"] == []


def test_stalled_server_alert(r, run_name):
    now = populate(r, run_name)
    k = RunKeys(run_name)
    nb = int(now // B)
    # gpu1 stops completing for the last 6 minutes; gpu0 keeps going.
    for b in range(nb - 36, nb):
        r.hdel(k.rate_bucket(b), f"req|{Bsrv}", f"tok|{Bsrv}")
    s = read_status(r, run_name)
    [alert] = s["alerts"]
    assert alert["kind"] == "stalled_server" and alert["server"] == Bsrv


def test_young_run_rate_is_not_diluted(r, run_name):
    # A run 60 s old at 2 req/s: the 5- and 15-minute rates say 2 req/s, not 0.4 / 0.13.
    now = redis_now(r)
    populated = populate(r, run_name, history_s=60, created_at=(now // B) * B - 60)
    s = read_status(r, run_name)
    age = s["time"] - ((populated // B) * B - 60)  # 60 s of results, then empty buckets
    for window in ("5m", "15m"):
        assert s["rates"][window]["req_per_s"] == pytest.approx(2.0 * 60 / age, abs=1e-3)
    assert s["rates"]["1m"]["req_per_s"] == pytest.approx(
        2.0 * covered_fraction(s, 60, populated), abs=1e-3)


def test_throughput_series(r, run_name):
    populate(r, run_name, history_s=600)
    s = read_status(r, run_name)
    series = s["throughput"]
    assert len(series) == 60
    assert [p["req_per_s"] for p in series[-10:]] == [2.0] * 10
    assert series[0]["req_per_s"] == 0.0
    assert series[-1]["t"] + 60 <= s["time"]


def test_fresh_run_without_results(r, run_name):
    k = RunKeys(run_name)
    r.hset(
        k.meta,
        mapping={"total": 10, "dataset": "/d", "fingerprint": "f", "created_at": redis_now(r)},
    )
    s = read_status(r, run_name)
    assert s["done"] == 0 and s["remaining"] == 10 and s["eta_s"] is None
    assert s["rate"] == {"req_per_s": 0.0, "tok_per_s": 0.0}
    assert s["finish_reasons"] == {} and s["truncation_rate"] == 0.0
    assert s["output_tokens"]["p50"] is None and s["servers"] == []
    assert s["params_version"] == 1 and s["params"]["max_tokens"] == 4096
    assert s["alerts"] == []
    assert s["failure_reasons"] == []
    assert orjson.loads(orjson.dumps(s)) == s  # JSON-serialisable as is, nothing lost
    text = rendered(s)
    assert "0 / 10 done" in text and "failed 0  remaining 10" in text
    assert "ETA —" in text and "finish —" in text and "output tokens" not in text


def test_unknown_run(r, run_name):
    with pytest.raises(UsageError, match=f"unknown run '{run_name}'"):
        read_status(r, run_name)
    with pytest.raises(UsageError):
        read_status(r, "bad name!")


def rendered(status: dict) -> str:
    console = Console(width=120, record=True, color_system=None)
    console.print(render_table(status))
    return console.export_text()


def test_failure_reasons_top_with_counts(r, run_name):
    populate(r, run_name)
    k = RunKeys(run_name)
    for index, reason in {
        500: "row 500: not valid JSON (unexpected character: line 1 column 2 (char 1))",
        501: "row 501: not valid JSON (unexpected character: line 1 column 9 (char 8))",
        502: "server refused the request (HTTP 400): [bad] <b>",
    }.items():
        record_failure(r, k, index, reason)
    r.hset(k.errors, "700", "HTTP 503")  # in flight again after a retry: not a failure
    s = read_status(r, run_name)
    assert s["failure_reasons"] == [
        {"reason": "row N: not valid JSON (unexpected character: …)", "count": 2,
         "example_index": 500},
        {"reason": "server refused the request (HTTP 400): [bad] <b>", "count": 1,
         "example_index": 502},
    ]
    assert s["failure_reasons_counted"] == 3
    text = rendered(s)
    assert "failed 2 x row N: not valid JSON (unexpected character: …) (e.g. index 500)" in text
    assert "failed 1 x server refused the request (HTTP 400): [bad] <b>" in text


def test_reasons_that_differ_only_in_numbers_or_urls_are_one_kind(r, run_name):
    """300 context refusals of a long-trace data set, each with its own token count, from three
    servers: one kind, so the 254 numbers of kinds never run out and status names the cause."""
    from test_scripts import claim, setup_run

    from genq.common.queue import scripts
    n = 300
    k, runner = setup_run(r, run_name, n + 1)
    for jid, idx, ex, _ in claim(runner, k, n):
        reason = (f"gave up after 3 attempts; last error: http://gpu-{idx % 3}.lan:30000/v1/chat/"
                  f"completions: server refused the request (HTTP 400): The input "
                  f"({40000 + idx} tokens) is longer than the model's context length "
                  f"(32768 tokens).")
        assert runner(scripts.fail_call(k, jid, idx, ex, reason=reason, worker="w")) == 1
    kind = ("gave up after N attempts; last error: <url>: server refused the request (HTTP 400): "
            "The input (N tokens) is longer than the model's context length (N tokens).")
    assert r.hkeys(k.fail_kinds) == [kind.encode()]
    jid, idx, ex, _ = claim(runner, k)[0]  # another cause still gets a kind of its own
    assert runner(scripts.fail_call(k, jid, idx, ex, reason="row 300: not a JSON object",
                                    worker="w")) == 1
    assert read_status(r, run_name)["failure_reasons"] == [
        {"reason": kind, "count": n, "example_index": 0},
        {"reason": "row N: not a JSON object", "count": 1, "example_index": n}]


def test_in_flight_is_split_into_running_and_claimed_ahead(r, run_name):
    populate(r, run_name)
    s = read_status(r, run_name)
    by = {row["server"]: row for row in s["servers"]}
    assert (by[A]["running"], by[A]["claimed_ahead"], by[A]["inflight"]) == (2, 1, 3)
    assert (s["running"], s["claimed_ahead"], s["inflight"]) == (2, 1, 5)
    assert "in flight 5 (running 2, claimed ahead 1)" in rendered(s)


def test_an_80_column_terminal_keeps_the_server_column(r, run_name):
    populate(r, run_name)
    console = Console(width=80, record=True, color_system=None)
    console.print(render_table(read_status(r, run_name)))
    text = console.export_text()
    for server in (A, Bsrv):
        assert server.split("://")[1] in text, text  # the server column, whole
    assert "seen" in text and max(len(line) for line in text.splitlines()) <= 80


def test_a_finished_run_says_so(r, run_name):
    k = RunKeys(run_name)
    r.hset(k.meta, mapping={"total": 3, "dataset": "/d.jsonl", "fingerprint": "f",
                            "created_at": redis_now(r)})
    for i in range(3):
        r.setbit(k.done, i, 1)
    s = read_status(r, run_name)
    assert s["finished"] and "finished" in rendered(s)
    r.setbit(k.done, 2, 0)
    assert not read_status(r, run_name)["finished"]


def test_render_table_is_readable(r, run_name):
    populate(r, run_name, length_per_bucket=4)
    s = read_status(r, run_name)
    text = rendered(s)
    assert "100 / 1,000 done" in text and "10.00%" in text
    assert "stop 83" in text and "length 17" in text and "p90 4,096" in text
    assert A.split("://")[1] in text and "2+1/40" in text and "38/1" in text
    assert "genq requeue --set max_tokens=8192 --redo truncated" in text
    assert human_duration(s["eta_s"]) in text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "—"),
        (5, "5s"),
        (125, "2m 5s"),
        (3 * 3600 + 60, "3h 1m"),
        (96100, "1d 2h 41m"),
    ],
)
def test_human_duration(seconds, text):
    assert human_duration(seconds) == text
