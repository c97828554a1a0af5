"""The monitor's maths: rates over buckets, ETA, exact percentiles, bins and alerts."""

from __future__ import annotations

import pytest

from genq.common.queue.keys import RATE_BUCKET_S as B
from genq.common.report import stats

NOW_BUCKET = 170_000_000
T0 = NOW_BUCKET * B  # the start of the current bucket


def steady(req: float, tok: float, first: int, last: int) -> dict[int, dict[str, float]]:
    """Buckets first..last (inclusive), each holding req and tok events."""
    return {b: {"req": req, "tok": tok} for b in range(first, last + 1)}


def test_rate_over_complete_buckets_and_partial_current():
    # 5 req per 10 s = 0.5 req/s for hours; the current bucket is 4 s old and holds 2 req.
    buckets = steady(5, 500, NOW_BUCKET - 400, NOW_BUCKET - 1)
    buckets[NOW_BUCKET] = {"req": 2, "tok": 200}
    now = T0 + 4
    # Window [now-300, now]: 29 whole buckets, 6 s of the oldest (3 req), the current 2 req.
    total, covered = stats.window_sum(buckets, "req", now, 300)
    assert covered == pytest.approx(300)
    assert total == pytest.approx(29 * 5 + 5 * 6 / 10 + 2)
    rate = stats.rates(buckets, now, 300)
    assert rate["req_per_s"] == pytest.approx(0.5, rel=1e-3)
    assert rate["tok_per_s"] == pytest.approx(50.0, rel=1e-3)


def test_rate_does_not_dip_when_a_new_bucket_starts():
    buckets = steady(5, 500, NOW_BUCKET - 400, NOW_BUCKET - 1)
    buckets[NOW_BUCKET] = {"req": 0.05, "tok": 5}  # 0.1 s into the bucket at 0.5 req/s
    rate = stats.window_rate(buckets, "req", T0 + 0.1, 60)
    assert rate == pytest.approx(0.5, rel=1e-3)


def test_young_run_divides_by_its_age_not_the_window():
    # A run started 60 s ago at 2 req/s: its 5- and 15-minute rates are 2 req/s, not 0.4.
    start = T0 - 56
    buckets = {b: {"req": 20, "tok": 100} for b in range(NOW_BUCKET - 5, NOW_BUCKET)}
    buckets[NOW_BUCKET - 6] = {"req": 12}  # the last 6 s of its first bucket
    buckets[NOW_BUCKET] = {"req": 8}  # 4 s into the current bucket
    since = stats.activity_start(buckets, created_at=start)
    assert since == start
    for window in (60, 300, 900):
        rate = stats.window_rate(buckets, "req", T0 + 4, window, since)
        assert rate == pytest.approx(2.0, rel=1e-6)


def test_activity_start_without_meta_uses_first_active_bucket():
    buckets = {NOW_BUCKET - 3: {"req": 1}, NOW_BUCKET - 2: {"tok": 5}}
    assert stats.activity_start(buckets) == (NOW_BUCKET - 3) * B
    # A created_at outside the first active bucket (another clock, a re-registration) is ignored.
    assert stats.activity_start(buckets, created_at=T0 + 100) == (NOW_BUCKET - 3) * B
    assert stats.activity_start({}, created_at=5.0) == 5.0
    assert stats.activity_start({}) is None


def test_two_observers_agree_regardless_of_when_they_started():
    # The rate is a function of Redis' buckets and Redis' clock only: recompute, same answer.
    buckets = steady(7, 700, NOW_BUCKET - 200, NOW_BUCKET - 1)
    buckets[NOW_BUCKET] = {"req": 3.5, "tok": 350}
    a = stats.rates(buckets, T0 + 5, 300, stats.activity_start(buckets))
    b = stats.rates(dict(buckets), T0 + 5, 300, stats.activity_start(dict(buckets)))
    assert a == b == {"req_per_s": pytest.approx(0.7), "tok_per_s": pytest.approx(70.0)}


def test_rate_zero_without_history():
    assert stats.rates({}, T0, 300) == {"req_per_s": 0.0, "tok_per_s": 0.0}
    # Under a second of history: no rate rather than a huge one.
    assert stats.window_rate({NOW_BUCKET: {"req": 3}}, "req", T0 + 0.5, 300, T0 + 0.2) == 0.0


def test_per_server_fields():
    buckets = {
        b: {"req": 3, "req|http://a:1": 2, "req|http://b:2": 1, "tok|http://a:1": 20}
        for b in range(NOW_BUCKET - 100, NOW_BUCKET)
    }
    a = stats.rates(buckets, T0, 300, suffix="|http://a:1")
    assert a == {"req_per_s": pytest.approx(0.2), "tok_per_s": pytest.approx(2.0)}
    assert stats.rates(buckets, T0, 300, suffix="|http://b:2")["req_per_s"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("remaining", "rate", "eta"),
    [
        (1000, 2.0, 500.0),
        (0, 0.0, 0.0),
        (10, 0.0, None),
        (904286, 9.39, 96303.1),
    ],
)
def test_eta(remaining, rate, eta):
    got = stats.eta_seconds(remaining, rate)
    assert got == (pytest.approx(eta, abs=0.1) if eta is not None else None)


def test_percentiles_exact_nearest_rank():
    hist = {v: 1 for v in range(1, 101)}  # 1..100
    assert stats.percentiles(hist) == {"mean": 50.5, "p50": 50, "p90": 90, "p99": 99, "max": 100}


def test_percentiles_with_a_cap_spike():
    # 82 completions of 1000 tokens, 18 hit the 4096 cap: P90 = P99 = the cap, like the real run.
    hist = {1000: 82, 4096: 18, 7: 0}
    out = stats.percentiles(hist)
    assert out["p50"] == 1000 and out["p90"] == 4096 and out["p99"] == 4096
    assert out["max"] == 4096
    assert out["mean"] == pytest.approx((1000 * 82 + 4096 * 18) / 100, abs=0.05)
    # Exactly at the boundary: rank ceil(0.82 * 100) = 82 is still 1000.
    assert stats.percentiles({1: 82, 2: 18})["p50"] == 1
    assert stats.percentiles({1: 90, 2: 10})["p90"] == 1
    assert stats.percentiles({1: 89, 2: 11})["p90"] == 2


def test_percentiles_single_and_empty():
    assert stats.percentiles({42: 1}) == {"mean": 42.0, "p50": 42, "p90": 42, "p99": 42, "max": 42}
    assert stats.percentiles({}) == {
        "mean": None,
        "p50": None,
        "p90": None,
        "p99": None,
        "max": None,
    }


def test_histogram_bins_cover_every_result():
    hist = {0: 1, 10: 2, 2047: 3, 4096: 18}
    bins = stats.histogram_bins(hist, bins=20)
    assert sum(b["count"] for b in bins) == 24
    assert bins[0] == {"lo": 0, "hi": 205, "count": 3}
    assert bins[-1]["lo"] <= 4096 < bins[-1]["hi"] and bins[-1]["count"] == 18
    assert all(b["hi"] - b["lo"] == 205 for b in bins)
    assert stats.histogram_bins({}) == []
    # Small values: bins one token wide, nothing past the last value.
    assert stats.histogram_bins({5: 2}, bins=20)[-1] == {"lo": 5, "hi": 6, "count": 2}


def test_truncation_rate():
    assert stats.truncation_rate(1710, 9500) == 0.18
    assert stats.truncation_rate(0, 0) == 0.0


def test_recent_truncation_uses_the_last_five_minutes_only():
    old = {b: {"req": 10, "fin|length": 10} for b in range(NOW_BUCKET - 100, NOW_BUCKET - 30)}
    new = {b: {"req": 10, "fin|length": 1} for b in range(NOW_BUCKET - 30, NOW_BUCKET)}
    rate, samples = stats.recent_truncation({**old, **new}, T0)
    assert rate == pytest.approx(0.1) and samples == 300


def test_truncation_alert_gives_the_exact_command():
    alert = stats.truncation_alert(0.18, 500, 4096, "default")
    assert alert["kind"] == "truncation"
    assert alert["command"] == "genq requeue --set max_tokens=8192 --redo truncated"
    assert "18%" in alert["message"] and "4096" in alert["message"]
    named = stats.truncation_alert(0.18, 500, 8192, "big")
    assert named["command"] == "genq requeue --set max_tokens=16384 --redo truncated --run big"


@pytest.mark.parametrize(
    ("rate", "samples", "threshold"),
    [
        (0.05, 500, 0.05),  # at the threshold, not above it
        (0.04, 500, 0.05),
        (0.5, 4, 0.05),  # too few completions to judge
        (0.2, 500, 0.25),
    ],
)
def test_no_truncation_alert(rate, samples, threshold):
    assert stats.truncation_alert(rate, samples, 4096, "default", threshold) is None


def test_truncation_alert_without_known_max_tokens_has_no_command():
    alert = stats.truncation_alert(0.3, 100, None, "default")
    assert alert is not None and "command" not in alert


def test_stall_alerts():
    recent = {"http://a:1": 12.0, "http://b:2": 0.0, "http://new:3": 0.0}
    known = {"http://a:1": 3600, "http://b:2": 3600, "http://new:3": 30}
    alerts = stats.stall_alerts(recent, known, remaining=100)
    assert [a["server"] for a in alerts] == ["http://b:2"]
    assert alerts[0]["kind"] == "stalled_server" and "http://b:2" in alerts[0]["message"]
    # Nothing left to do: an idle server is fine.
    assert stats.stall_alerts(recent, known, remaining=0) == []


def test_throughput_series():
    buckets = steady(6, 600, NOW_BUCKET - 12, NOW_BUCKET - 1)
    buckets[NOW_BUCKET] = {"req": 100, "tok": 1}  # the incomplete bucket is left out
    series = stats.throughput_series(buckets, NOW_BUCKET, points=3, group=6)
    assert [p["t"] for p in series] == [T0 - 180, T0 - 120, T0 - 60]
    assert [p["req_per_s"] for p in series] == [0.0, 0.6, 0.6]
    assert series[-1]["tok_per_s"] == 60.0
