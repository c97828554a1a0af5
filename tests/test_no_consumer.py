"""Work queued and no consumer alive (a crash loop, consumers under another run name or user):
`genq status` and the monitor page say so, instead of figures that merely look idle."""

from __future__ import annotations

import contextlib
import json
import time

import orjson
from conftest import genq
from test_monitor import Monitor

from genq.common.queue.keys import RunKeys
from genq.common.report.status import read_status


def no_consumer(status: dict) -> list[dict]:
    return [a for a in status["alerts"] if a["kind"] == "no_consumer"]


def test_queued_work_with_no_consumer_alive_is_an_alert(tmp_path, redis_url, r, run_name):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p {i}"}) + "\n" for i in range(40)))
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    k = RunKeys(run_name)
    # A consumer that started and died (crash loop): its name stays, its heartbeat expired.
    r.zadd(k.consumers, {"crashed": time.time() - 60})
    monitor = Monitor(redis_url, run_name, tmp_path)
    try:
        status = monitor.status()  # the monitor itself stays up and answers
        page = page_alerts(monitor)
    finally:
        monitor.stop()
    assert status["queued"] == 40 and status["inflight"] == 0
    [alert] = no_consumer(status)
    assert "no consumer" in alert["message"] and "40" in alert["message"]
    assert alert["message"] in page
    table = genq("status", redis_url=redis_url, run=run_name).stdout
    assert "no consumer" in " ".join(table.split())
    [alert] = no_consumer(orjson.loads(genq("status", "--json", redis_url=redis_url,
                                            run=run_name).stdout))
    # A live heartbeat clears it.
    r.set(k.consumer("c1"), orjson.dumps({"name": "c1", "server": "http://gpu:1"}), ex=15)
    r.zadd(k.consumers, {"c1": time.time()})
    assert no_consumer(read_status(r, run_name)) == []


def page_alerts(monitor: Monitor) -> str:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        with contextlib.closing(browser):
            page = browser.new_page()
            page.goto(monitor.url + "/")
            page.wait_for_function("document.body.dataset.loaded === '1'")
            return page.inner_text("#alerts")
