"""The simulator's KV-cache pool (--max-total-tokens): running requests' tokens must fit in it
together, so a small pool holds requests back even with slots free, and /v1/loads reports
the pool's use in real SGLang 0.5.23's fields (num_used_tokens, max_total_num_tokens,
token_usage, gen_throughput)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from test_simulator import chat, wait_for

pytest_plugins = ["sim_fixtures"]


def rank(url: str) -> dict:
    return httpx.get(url + "/v1/loads", timeout=5).json()["loads"][0]


def test_pool_limits_admission_and_loads_report_its_use(sim_factory):
    # 4 prompt tokens + 1,000 output tokens = 1,004 per request: 2 fit in 2,500, not 3.
    sim = sim_factory(max_running_requests=8, max_total_tokens=2500, time_scale=10,
                      length_dist="fixed:1000")
    idle = rank(sim.url)
    assert idle["max_total_num_tokens"] == 2500 and idle["num_used_tokens"] == 0
    assert idle["token_usage"] == 0.0 and idle["gen_throughput"] == 0.0
    with ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(chat, sim.url, "a b c d", 30, max_tokens=1000) for _ in range(4)]
        wait_for(lambda: rank(sim.url)["num_waiting_reqs"] == 2)
        wait_for(lambda: rank(sim.url)["num_used_tokens"] > 100)
        busy = rank(sim.url)
        assert busy["num_running_reqs"] == 2 and busy["max_running_requests"] == 8
        assert 8 < busy["num_used_tokens"] <= 2 * 1004
        assert busy["token_usage"] == busy["num_used_tokens"] / 2500
        # Two requests decode at 87.5 tok/s each, ten times faster than real time.
        assert busy["gen_throughput"] == 2 * 87.5 * 10
        assert all(a.result().status_code == 200 for a in answers)
    assert rank(sim.url)["num_used_tokens"] == 0


def test_default_pool_does_not_limit_the_slots(sim_factory):
    sim = sim_factory(max_running_requests=6, time_scale=10, length_dist="fixed:1000")
    assert rank(sim.url)["max_total_num_tokens"] == 1_000_000
    with ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(chat, sim.url, "a b c d", 30, max_tokens=1000) for _ in range(8)]
        # the slots, not the pool, hold them: 6 running and 2 waiting once all 8 have arrived
        # (under load the 8th may come after the 6th runs, so both are waited for)
        wait_for(lambda: (rank(sim.url)["num_running_reqs"],
                          rank(sim.url)["num_waiting_reqs"]) == (6, 2))
        assert all(a.result().status_code == 200 for a in answers)
