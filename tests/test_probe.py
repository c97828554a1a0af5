"""`genq requeue --probe`: the statistics as pure functions, and end to end on the simulator:
a probe of the truncated prompts at a larger max_tokens touches no result, predicts the
truncation rate the full redo then measures (within its interval), and keeps none of its
answers: the commit generates every redone prompt."""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest
from conftest import genq
from pipeline import ConsumerProcess, read_jsonl, wait_for, write_dataset
from test_monitor import Monitor

from genq.common.queue.keys import RunKeys
from genq.common.report.stats import wilson
from genq.common.report.status import read_status
from genq.producer.probe import summarize

pytestmark = pytest.mark.timeout(300)
FLAGS = ("--poll", "0.05", "--server-wait", "60", "--visibility-timeout", "30", "--grace", "2")


def test_wilson_interval_matches_known_values():
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson(18, 100) == pytest.approx((0.1170, 0.2667), abs=1e-4)  # by hand
    assert wilson(0, 0) == (0.0, 1.0)


def test_percentiles_are_nearest_rank_values():
    def lengths(*tokens: int) -> dict:
        return summarize([(t, "stop") for t in tokens], [], population=len(tokens), remaining=0,
                         remaining_mean=0.0, tok_per_s=0.0, servers=0)

    assert lengths(5, 1, 3, 2, 4)["length_p50"] == 3 and lengths(5, 1, 3, 2, 4)["length_p90"] == 5
    assert lengths()["length_p50"] is None


def test_summary_projects_the_whole_redo():
    # 10 probed: 2 still cut at 8192, 8 ended at 5000; their current results hold 4096 each.
    new = [(8192, "length")] * 2 + [(5000, "stop")] * 8
    rep = summarize(new, [4096] * 10, population=1000, remaining=100, remaining_mean=2400.0,
                    tok_per_s=7000.0, servers=7)
    assert rep["probe_n"] == 10 and rep["truncation_rate"] == 0.2
    assert rep["truncation_ci"] == [0.0567, 0.5098]
    assert rep["length_mean"] == 5638.4 and rep["length_p50"] == 5000
    assert rep["length_p90"] == 8192
    assert rep["extra_tokens"] == 1_542_400  # 1,000 x (5,638.4 - 4,096)
    assert rep["redo_tokens"] == 5_638_400  # 1,000 x 5,638.4: the probed run again too
    assert rep["gpu_s"] == 5638.4  # at 1,000 tok/s per GPU (7,000 over 7)
    assert rep["eta_s"] == 839.8  # (100 x 2,400 + 5,638,400) / 7,000


def sim_stats(url: str) -> dict:
    return httpx.get(url + "/_sim/stats", timeout=5).json()


def settled(r, k: RunKeys, total: int) -> bool:
    return (r.bitcount(k.done) == total and not r.zcard(k.leases)
            and not r.llen(k.rq_queue))


def test_probe_predicts_the_redo_and_touches_nothing(sim_factory, redis_url, run_name, r,
                                                     tmp_path):
    sim = sim_factory(time_scale=1000)  # default lengths: ~18 % cut at max_tokens 4096
    total = 300
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", total)), "--once",
         "--max-tokens", "4096", redis_url=redis_url, run=run_name)
    consumer = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "out", *FLAGS)
    k = RunKeys(run_name)
    try:
        wait_for(lambda: settled(r, k, total), timeout=120, what="the first pass")
        cut = int(r.bitcount(k.truncated))
        assert 0.1 < cut / total < 0.3
        generated = sim_stats(sim.url)["completed"]

        probe = genq("requeue", "--probe", "30", "--set", "max_tokens=8192", "--json",
                     redis_url=redis_url, run=run_name)
        rep = json.loads(probe.stdout)
        assert rep["probe_n"] == 30 and rep["population"] == cut
        assert not rep["errors"]
        low, high = rep["truncation_ci"]
        assert low <= rep["truncation_rate"] <= high and rep["length_p90"] <= 8192
        assert rep["length_p50"] > 4096 and rep["extra_tokens"] > 0 and rep["eta_s"] is not None
        # The probe touched no result: same version, same done and truncated.
        assert int(r.get(k.params_version) or 1) == 1 and int(r.bitcount(k.truncated)) == cut
        assert int(r.bitcount(k.done)) == total
        assert sim_stats(sim.url)["completed"] == generated + 30

        genq("requeue", "--set", "max_tokens=8192", "--redo", "truncated",
             redis_url=redis_url, run=run_name)
        wait_for(lambda: settled(r, k, total), timeout=120, what="the redo")
        measured = int(r.bitcount(k.truncated)) / cut
        assert low <= measured <= high, (measured, rep)
        # Every redone prompt was generated again, the probed ones too.
        assert sim_stats(sim.url)["completed"] == generated + 30 + cut
        redone = [x for f in (tmp_path / "out").glob("*.jsonl") for x in read_jsonl(f)
                  if x["params_version"] == 2]
        assert len(redone) == cut and all(x["completion_tokens"] <= 8192 for x in redone)

        # "Is 8k enough?": the rate under v2 alone, live, and the advice while it is high.
        status = read_status(r, run_name)
        vt = status["version_truncation"]
        assert vt["version"] == 2 and vt["completions"] == cut
        assert vt["truncated"] == int(r.bitcount(k.truncated)) and vt["rate"] == round(
            measured, 4)
        assert vt["ci"][0] <= vt["rate"] <= vt["ci"][1]
        [alert] = [a for a in status["alerts"] if a["kind"] == "truncation"]
        assert f"of the {cut} completions under v2 (max_tokens=8192)" in alert["message"]
        assert alert["command"].startswith("genq requeue --set max_tokens=16384")
        shown = genq("status", redis_url=redis_url, run=run_name).stdout
        assert f"under v2: {measured:.1%} truncated" in shown
        page = page_figures(Monitor(redis_url, run_name, tmp_path))
        assert page == ("v2", f"{100 * vt['rate']:.1f}%")
    finally:
        consumer.cleanup()


def test_probe_needs_parameters_and_a_live_consumer(redis_url, run_name, r, tmp_path):
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", 5)), "--once",
         redis_url=redis_url, run=run_name)
    no_set = genq("requeue", "--probe", "5", redis_url=redis_url, run=run_name, check=False)
    assert no_set.returncode != 0 and "--probe needs" in no_set.stderr
    bad = genq("requeue", "--probe", "0", "--set", "max_tokens=8192", redis_url=redis_url,
               run=run_name, check=False)
    assert bad.returncode == 2 and "at least 1" in bad.stderr
    args = ("requeue", "--probe", "5", "--set", "max_tokens=8192", "--redo", "all")
    empty = genq(*args, redis_url=redis_url, run=run_name, check=False)
    assert empty.returncode == 2 and "nothing to probe" in empty.stderr  # nothing done yet
    r.setbit(RunKeys(run_name).done, 3, 1)  # one result, as ack.lua marks it
    nobody = genq(*args, redis_url=redis_url, run=run_name, check=False)
    assert nobody.returncode == 2 and "no live consumer" in nobody.stderr
    assert nobody.stderr.count("\n") == 1  # one clear line


def page_figures(monitor: Monitor) -> tuple[str, str]:
    """What the monitor page shows for the current version's truncation."""
    from playwright.sync_api import sync_playwright

    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium",
                                        args=["--no-sandbox"])
            with contextlib.closing(browser):
                page = browser.new_page()
                page.goto(monitor.url + "/")
                page.wait_for_function(
                    "document.getElementById('version-truncation-rate').dataset.value")
                return (page.text_content("#vt-version"),
                        page.text_content("#version-truncation-rate"))
    finally:
        monitor.stop()


def test_the_report_reads_for_a_person():
    from genq.producer.probe import describe

    rep = summarize([(8192, "length")] * 2 + [(5000, "stop")] * 8, [4096] * 10,
                    population=1000, remaining=100, remaining_mean=2400.0, tok_per_s=7000.0,
                    servers=7)
    text = describe({**rep, "changes": {"max_tokens": 8192}, "population_mode": "none",
                     "errors": []})
    assert "truncated at the new limit: 2/10 = 20.0% (95% CI 5.7% - 51.0%)" in text
    assert "new length: mean 5,638, p50 5,000, p90 8,192" in text
    assert "5,638,400 tokens to generate, +1,542,400 tokens in the data set" in text
    assert "GPU time 1.6 h (5,638 s)" in text and "ETA with the redo, at 7,000 tok/s" in text
