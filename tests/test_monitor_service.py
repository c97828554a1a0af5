"""The monitor's service as its neighbours meet it: where it listens, what a finished run
shows, what a GET costs Redis."""

from __future__ import annotations

import contextlib
import math
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_monitor import Monitor, populate

from genq.common.queue.keys import RunKeys


def test_the_monitor_listens_on_loopback_only_by_default(redis_url, r, run_name, tmp_path):
    """No auth: unless --host says otherwise, only this machine reaches it. 127.0.0.2 is this
    machine too, but not the address 127.0.0.1 binds (0.0.0.0 answers on it)."""
    populate(r, run_name)
    monitor = Monitor(redis_url, run_name, tmp_path, host=None)
    try:
        assert monitor.get("/api/status")[0] == 200
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", monitor.port), timeout=5).close()
    finally:
        monitor.stop()


def test_the_page_marks_a_finished_run(redis_url, r, run_name, tmp_path):
    """A run whose every prompt is done or failed says so on the page, not only in figures."""
    from playwright.sync_api import sync_playwright

    k = RunKeys(run_name)
    r.hset(k.meta, mapping={"total": 10, "dataset": "/d.jsonl", "fingerprint": "f",
                            "created_at": time.time()})
    r.setrange(k.done, 0, b"\xff")  # 0..7 done
    r.setbit(k.failed, 8, 1)  # 9 still to do
    monitor = Monitor(redis_url, run_name, tmp_path)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium",
                                        args=["--no-sandbox"])
            with contextlib.closing(browser):
                page = browser.new_page()
                page.goto(monitor.url + "/")
                page.wait_for_function("document.getElementById('done').dataset.value === '8'")
                unfinished = page.is_visible("#finished")
                r.setbit(k.done, 9, 1)
                page.wait_for_function("document.getElementById('done').dataset.value === '9'")
                mark = page.is_visible("#finished") and page.text_content("#finished")
    finally:
        monitor.stop()
    assert not unfinished
    assert mark and "finished" in mark


def status_reads(r) -> int:
    """How many status reads Redis served: each is one MULTI (common.report.status._read)."""
    return int(r.info("commandstats").get("cmdstat_multi", {}).get("calls", 0))


def test_many_gets_within_a_second_read_redis_once(redis_url, r, run_name, tmp_path):
    """A page per viewer polling, and Prometheus scraping, cost one status read a second, not one
    per GET: the status is kept for a second."""
    populate(r, run_name)
    monitor = Monitor(redis_url, run_name, tmp_path, interval=3600)  # no progress-file reads
    try:
        assert monitor.get("/api/status")[0] == 200
        r.config_resetstat()
        start = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda path: monitor.get(path)[0],
                                  ["/api/status", "/metrics"] * 20))
        spanned = time.monotonic() - start
        reads = status_reads(r)
    finally:
        monitor.stop()
    assert codes == [200] * 40
    # One read per second the burst spanned, and one for the second it began in.
    assert reads <= math.ceil(spanned) + 1, (reads, spanned)
