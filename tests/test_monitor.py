"""The monitor as a user meets it: a process serving the page, the JSON, metrics, a file."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest
from conftest import REPO, free_port, genq_env, wait_port
from pipeline import queue_jobs, record_failure, take_leases, wait_for
from prometheus_client.parser import text_string_to_metric_families
from test_status import covered_fraction

from genq.common.queue.keys import RATE_BUCKET_S, RunKeys
from genq.monitor.status_cli import status_main

SERVER = 'http://gpu0:30000/"odd"\\path'  # a label value that needs escaping
REASON = 'server refused the request (HTTP 400): <img src=x onerror="window.pwned=true"> & co'


def populate(r, run: str, *, length_per_bucket: int = 4) -> float:
    """A run mid-way: 100 of 1000 done, 20 truncated, 2 req/s for the 30 minutes up to the
    bucket it ran in; returns its Redis time."""
    k = RunKeys(run)
    sec, usec = r.time()
    now = sec + usec / 1e6
    nb = int(now // RATE_BUCKET_S)
    r.hset(
        k.meta,
        mapping={
            "total": 1000,
            "dataset": "/d.jsonl",
            "fingerprint": "f",
            "created_at": now - 3600,
        },
    )
    r.setrange(k.done, 0, b"\xff" * 12 + b"\xf0")  # indices 0..99
    r.setbit(k.failed, 999, 1)
    record_failure(r, k, 999, REASON)
    r.set(k.params_version, 3)
    take_leases(r, run, list(range(100, 107)), SERVER)  # as claim.lua writes them
    queue_jobs(r, run, list(range(200, 230)))
    r.hset(
        k.counters,
        mapping={"finish:stop": 80, "finish:length": 20, "ctok_sum": 160_000, "ptok_sum": 9_000,
                 "continued|3": 7, "saved|3": 2_800,  # requeue --continue under v3
                 "invalid|3": 5, "schema_failed|3": 1,  # --schema: answers not matching it,
                 "schema_cut|3": 2,  # and cut at max_tokens
                 "schema_unkept|3": 1},  # and failed prompts Redis keeps no answer of
    )
    r.rpush(k.params_history, orjson.dumps({"version": 3, "changes": {"max_tokens": [2048, 4096]},
                                            "redo": "truncated", "inflight": "abort", "at": 1}))
    r.hset(k.length_hist, mapping={"1000": 60, "2000": 20, "4096": 20})
    r.set(k.params_version, 3)
    r.hset(k.params, "3", orjson.dumps({"max_tokens": 4096}))
    for b in range(nb - 180, nb):
        r.hset(
            k.rate_bucket(b),
            mapping={
                "req": 20,
                "tok": 40_000,
                f"req|{SERVER}": 20,
                f"tok|{SERVER}": 40_000,
                "fin|length": length_per_bucket,
                "fin|stop": 20 - length_per_bucket,
                "vreq|3": 20,  # all under the current version 3
                "vlen|3": length_per_bucket,
            },
        )
    r.zadd(k.consumers, {"c0": now})
    r.set(
        k.consumer("c0"),
        orjson.dumps(
            {
                "name": "c0",
                "server": SERVER,
                "capacity": 40,
                "inflight": 7,
                "running": 5,
                "ahead": 1,
                "load": {"num_reqs": 7, "num_waiting_reqs": 0},
                "host": "h",
                "pid": 1,
            }
        ),
    )
    return now


class Monitor:
    def __init__(self, redis_url: str, run: str, tmp: Path, interval: float = 0.5,
                 host: str | None = "127.0.0.1") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.progress = tmp / f"progress-{self.port}.json"
        self.log = tmp / f"monitor-{self.port}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "monitor",
                    *(["--host", host] if host else []),
                    "--port",
                    str(self.port),
                    "--redis-url",
                    redis_url,
                    "--run",
                    run,
                    "--progress-file",
                    str(self.progress),
                    "--interval",
                    str(interval),
                ],
                env=genq_env(redis_url, run),
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_port(self.port)

    def get(self, path: str) -> tuple[int, bytes, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as resp:
                return resp.status, resp.read(), resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.read(), e.headers.get("Content-Type", "")

    def status(self) -> dict:
        code, body, _ = self.get("/api/status")
        assert code == 200, body
        return json.loads(body)

    def conversation_texts(self, *ids: str) -> dict[str, str | None]:
        """The text of each element `ids` names on the page in Chromium, once its conversations
        panel shows."""
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium",
                                        args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(self.url + "/")
            page.wait_for_function("!document.getElementById('conversations').hidden")
            shown = {i: page.text_content(f"#{i}") for i in ids}
            browser.close()
        return shown

    def stop(self) -> str:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        return self.log.read_text()


@pytest.fixture
def monitor(redis_url, run_name, r, tmp_path):
    populated = populate(r, run_name)
    m = Monitor(redis_url, run_name, tmp_path)
    m.populated = populated
    yield m
    m.stop()


def test_api_status(monitor, run_name):
    s = monitor.status()
    assert (s["run"], s["total"], s["done"], s["failed"], s["queued"], s["inflight"]) == (
        run_name,
        1000,
        100,
        1,
        30,
        7,
    )
    assert s["params_version"] == 3
    # 2 req/s over the share of 5 min with data (a bucket boundary may pass while it starts)
    assert s["rate"]["req_per_s"] == pytest.approx(
        2.0 * covered_fraction(s, 300, monitor.populated), abs=1e-3)
    assert s["finish_reasons"] == {"stop": 80, "length": 20}
    assert s["output_tokens"]["p50"] == 1000 and s["output_tokens"]["p90"] == 4096
    [server] = s["servers"]
    assert server["server"] == SERVER and server["inflight"] == 7 and server["capacity"] == 40
    [alert] = s["alerts"]  # 20 % of the last 5 minutes hit max_tokens
    assert alert["command"].startswith("genq requeue --set max_tokens=8192 --redo truncated")


def test_metrics_are_valid_prometheus(monitor, run_name):
    code, body, ctype = monitor.get("/metrics")
    assert code == 200 and ctype.startswith("text/plain; version=0.0.4")
    check = subprocess.run(
        ["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    run = (("run", run_name),)
    assert samples[("genq_done_total", run)] == 100
    assert samples[("genq_failed_total", run)] == 1
    assert samples[("genq_output_tokens_total", run)] == 160_000
    assert samples[("genq_prompts", run)] == 1000
    assert samples[("genq_queued", run)] == 30 and samples[("genq_inflight", run)] == 7
    assert samples[("genq_params_version", run)] == 3
    assert samples[("genq_truncation_rate", run)] == 0.2
    assert samples[("genq_eta_seconds", run)] == pytest.approx(899 / 2.0, rel=0.05)
    by_server = (("run", run_name), ("server", SERVER))
    assert samples[("genq_server_inflight", by_server)] == 7
    assert samples[("genq_server_capacity", by_server)] == 40
    assert samples[("genq_server_requests_per_second", by_server)] == pytest.approx(2.0, rel=0.04)
    assert samples[("genq_failed_by_reason", (("reason", REASON), ("run", run_name)))] == 1


def test_progress_file_is_kept_current(monitor):
    deadline = time.monotonic() + 10
    while not monitor.progress.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    first = json.loads(monitor.progress.read_text())
    assert first["done"] == 100 and first["total"] == 1000
    # --interval 0.5: rewritten at the next ticks (never seen half-written, always whole JSON)
    wait_for(lambda: json.loads(monitor.progress.read_text())["time"] > first["time"],
             timeout=10, what="the progress file rewritten")
    assert not list(monitor.progress.parent.glob(".progress-*.tmp"))


def test_read_only(monitor):
    for method in ("POST", "PUT", "DELETE"):
        req = urllib.request.Request(monitor.url + "/api/status", data=b"{}", method=method)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        with e.value:
            assert e.value.code == 405
    assert monitor.get("/nope")[0] == 404


def test_a_fresh_monitor_agrees_with_a_running_one(monitor, redis_url, run_name, tmp_path):
    time.sleep(1.0)  # the first monitor has been up for a while
    fresh = Monitor(redis_url, run_name, tmp_path)
    try:
        # The running monitor read before and after the fresh one: rates of a finished past
        # move with the clock, and on a loaded machine the reads are a second or more apart.
        a, b, a_after = monitor.status(), fresh.status(), monitor.status()
    finally:
        fresh.stop()
    for window in ("1m", "5m", "15m"):
        got, ends = b["rates"][window]["req_per_s"], sorted(
            (a["rates"][window]["req_per_s"], a_after["rates"][window]["req_per_s"]))
        assert ends[0] * 0.98 <= got <= ends[1] * 1.02, (window, got, ends)
    etas = sorted((a["eta_s"], a_after["eta_s"]))
    assert etas[0] * 0.98 <= b["eta_s"] <= etas[1] * 1.02, (b["eta_s"], etas)
    assert (a["done"], a["finish_reasons"], a["output_tokens"]) == (
        b["done"],
        b["finish_reasons"],
        b["output_tokens"],
    )


def test_unknown_run_and_unreachable_redis_keep_the_monitor_up(redis_url, r, run_name, tmp_path):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    down = Monitor(dead, run_name, tmp_path)
    unknown = Monitor(redis_url, run_name, tmp_path)
    try:
        code, body, _ = down.get("/api/status")
        assert code == 503 and "cannot reach Redis" in json.loads(body)["error"]
        code, body, _ = unknown.get("/api/status")
        assert code == 503 and f"unknown run '{run_name}'" in json.loads(body)["error"]
        assert b"genq_status_up" in unknown.get("/metrics")[1]
        populate(r, run_name)  # the run appears: the same process recovers
        assert unknown.status()["done"] == 100
    finally:
        log = down.stop()
        unknown.stop()
    assert "redis_unreachable" in log and "Traceback" not in log


def test_status_cli(redis_url, r, run_name, capsys):
    populate(r, run_name)
    assert status_main(["--redis-url", redis_url, "--run", run_name, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["done"] == 100 and s["run"] == run_name
    assert status_main(["--redis-url", redis_url, "--run", run_name]) == 0
    out = capsys.readouterr().out
    assert "100 / 1,000 done" in out and "genq requeue --set max_tokens=8192" in out
    assert s["continued"] == {"3": {"continued": 7, "decode_tokens_saved": 2800}}
    assert "7 continued, 2,800 decode tokens saved" in out
    assert s["schema"] == {"3": {"invalid": 5, "failed": 1, "cut": 2, "unkept": 1}}
    assert ("schema: 5 answers invalid, 1 prompts failed, 2 answers cut at max_tokens (not JSON)"
            ", 1 answers not kept in Redis" in " ".join(out.split()))  # wrapped
    assert status_main(["--redis-url", redis_url, "--run", "nosuchrun"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown run 'nosuchrun'" in err
    dead = f"redis://127.0.0.1:{free_port()}/0"
    assert status_main(["--redis-url", dead, "--run", run_name]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach Redis" in err


def test_page_shows_the_status(monitor):
    from playwright.sync_api import sync_playwright

    artifacts = REPO / "artifacts"
    artifacts.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        with contextlib.closing(browser):
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.goto(monitor.url + "/")
            page.wait_for_function("document.getElementById('done').dataset.value !== undefined")
            s = monitor.status()
            shown = {
                i: page.text_content(f"#{i}")
                for i in (
                    "done",
                    "total",
                    "queued",
                    "inflight",
                    "failed",
                    "params-version",
                    "rate-req",
                    "rate-tok",
                    "eta",
                    "truncation-rate",
                    "len-p50",
                    "len-p90",
                    "pct",
                )
            }
            page.wait_for_timeout(300)  # let the bar's width transition settle for the picture
            page.screenshot(path=str(artifacts / "monitor.png"), full_page=True)
            alert = page.text_content("#alert-command-0")
            reasons = page.text_content("#failure-reasons")
            history = page.text_content("#params-history")
            injected = page.evaluate("window.pwned") or page.query_selector("#failure-reasons img")
            row = page.text_content(
                f"tr[data-server='{SERVER.replace(chr(92), chr(92) * 2)}']".replace('"', '\\"')
            )
    num = lambda text: float(text.replace(",", "").rstrip("%"))  # noqa: E731
    assert num(shown["done"]) == s["done"] and num(shown["total"]) == s["total"]
    assert num(shown["queued"]) == s["queued"] and num(shown["inflight"]) == s["inflight"]
    assert num(shown["failed"]) == s["failed"] and shown["params-version"] == "v3"
    assert shown["pct"] == "10.00%"
    assert num(shown["rate-req"]) == pytest.approx(s["rate"]["req_per_s"], abs=0.05)
    assert num(shown["rate-tok"]) == pytest.approx(s["rate"]["tok_per_s"], rel=0.02)
    assert shown["eta"].endswith("s") and "m" in shown["eta"]  # ~7 minutes, human-readable
    assert shown["truncation-rate"] == "20.0%"
    assert num(shown["len-p50"]) == 1000 and num(shown["len-p90"]) == 4096
    assert alert == s["alerts"][0]["command"]
    assert "5+1 / 40" in row and "(+1 other)" in row  # running + ahead, and a lease besides
    # The failure reason is shown with its count, as text: its markup is never parsed.
    assert s["failure_reasons"] == [{"reason": REASON, "count": 1, "example_index": 999}]
    assert REASON in reasons and reasons.startswith("1") and not injected
    assert "7 continued, 2,800 decode tokens saved" in history
    assert ("schema: 5 answers invalid, 1 prompts failed, 2 answers cut at max_tokens (not JSON)"
            ", 1 answers not kept in Redis" in history)


def test_the_log_says_what_the_page_says(monitor, run_name):
    """The truncation alert reaches the log once, with the exact command that fixes it."""
    wait_for(lambda: b'"alert"' in monitor.log.read_bytes(), what="an alert in the log")
    # A few more ticks (each rewrites the progress file): still logged once.
    seen = json.loads(monitor.progress.read_text())["time"] if monitor.progress.exists() else 0
    for _ in range(2):
        wait_for(lambda seen=seen: monitor.progress.exists() and
                 json.loads(monitor.progress.read_text())["time"] > seen, timeout=10,
                 what="another tick")
        seen = json.loads(monitor.progress.read_text())["time"]
    alerts = [json.loads(line) for line in monitor.stop().splitlines()
              if line.startswith("{") and json.loads(line).get("event") == "alert"]
    assert len(alerts) == 1 and alerts[0]["kind"] == "truncation"
    assert alerts[0]["command"].startswith("genq requeue --set max_tokens=8192 --redo truncated")


def test_the_monitor_reaps_expired_leases(monitor, r, run_name):
    """With every consumer gone, the monitor alone returns expired leases to the queue."""
    from genq.common.queue import feed, scripts

    k = RunKeys(run_name)
    runner = scripts.ScriptRunner(r)
    r.delete(k.rq_queue)
    feed.enqueue(r, k, [500], runner)
    runner(scripts.claim_call(k, 1, 0.2, "http://dead:1", "gone", "x"))
    job = f"{run_name}-500"
    assert r.zscore(k.leases, job) is not None
    wait_for(lambda: r.zscore(k.leases, job) is None, timeout=10, what="the lease reaped")
    assert r.lrange(k.rq_queue, 0, -1) == [job.encode()]
