"""Capacity advice as pure functions over load samples: when it says raise, lower or nothing,
the value it suggests, and the evidence it names."""

from __future__ import annotations

from genq.common.report import advice
from genq.common.report.advice import capacity_advice, load_sample

S = "http://gpu0:30000"
NOW = 10_000.0


def history(n=60, step=2.5, running=16, cap=16, waiting=0, used=16 * 1200, pool=1_000_000,
            gen=1400.0, end=NOW):
    """n samples ending at `end`, as the consumer records them from /v1/loads."""
    out = []
    for i in range(n):
        load = {"num_reqs": running, "max_running_requests": cap, "num_waiting_reqs": waiting,
                "num_used_tokens": used, "max_total_num_tokens": pool, "gen_throughput": gen}
        out.append(load_sample(end - (n - 1 - i) * step, load))
    return out


def test_busy_slots_and_free_kv_say_raise_bounded_by_kv():
    # 16 x 1,200 tokens in a 1M pool (2 %): the KV bound is 0.8 * 1M / 2,400 = 333, so the
    # step limit decides: 16 * 2.5 = 40, the value the run genq is built for settled on.
    a = capacity_advice(S, history(), NOW)
    assert a["kind"] == "raise" and a["current"] == 16 and a["suggested"] == 40
    ev = a["evidence"]
    assert ev["running_mean"] == 16 and ev["waiting_max"] == 0
    assert ev["token_usage_max"] == 0.0192 and ev["max_total_num_tokens"] == 1_000_000
    assert ev["gen_throughput_mean"] == 1400.0 and ev["window_s"] >= 90
    assert "--max-running-requests to 40" in a["message"] and "2%" in a["message"]


def test_kv_headroom_caps_the_suggested_value():
    # 16 requests hold 16 x 5,000 tokens of 250,000 (32 %): 0.8 * 250k / 10k = 20 fit.
    a = capacity_advice(S, history(used=16 * 5000, pool=250_000), NOW)
    assert a["kind"] == "raise" and a["suggested"] == 20
    assert a["evidence"]["tokens_per_request_max"] == 5000


def test_waiting_requests_say_lower():
    a = capacity_advice(S, history(running=12, waiting=4), NOW)
    assert a["kind"] == "lower" and a["suggested"] == 12
    assert "waiting" in a["message"]


def test_full_kv_says_lower_to_what_fits():
    a = capacity_advice(S, history(running=40, cap=40, used=950_000), NOW)
    assert a["kind"] == "lower"
    assert a["suggested"] == int(40 * 0.8 / 0.95)  # 33: the running load at 80 % of the pool


def test_no_advice_without_a_sustained_window():
    assert capacity_advice(S, history(n=10), NOW) is None  # 22 s of samples, window 120 s
    assert capacity_advice(S, history(), NOW + 60) is None  # the consumer stopped reporting
    assert capacity_advice(S, [], NOW) is None and capacity_advice(S, None, NOW) is None


def test_a_capacity_change_restarts_the_window():
    # Raised to 40 a minute ago: the 16-slot samples before it are not evidence any more.
    old = history(n=40, end=NOW - 60)
    new = history(n=24, cap=40, running=40, end=NOW)
    assert capacity_advice(S, old + new, NOW) is None
    assert capacity_advice(S, old + new, NOW, window_s=50)["current"] == 40


def test_idle_slots_or_busy_kv_give_no_raise():
    assert capacity_advice(S, history(running=10), NOW) is None  # slots not all busy
    assert capacity_advice(S, history(used=600_000), NOW) is None  # KV 60 %: neither
    # A server that does not report its KV pool (older SGLang) is never told to raise.
    assert capacity_advice(S, history(pool=None, used=None), NOW) is None


def test_malformed_samples_are_ignored():
    h = history() + [[1, 2], "x", None]
    assert capacity_advice(S, h, NOW)["suggested"] == 40  # the good samples still count
    assert advice.as_dicts([[1, 2], "x"]) == []


def test_alert_names_the_flag_and_value():
    a = capacity_advice(S, history(), NOW)
    alert = advice.advice_alert(a)
    assert alert == {"kind": "capacity", "server": S, "message": a["message"],
                     "command": "--max-running-requests 40"}
