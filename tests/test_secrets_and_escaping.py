"""No secret is shown and no markup runs: credentials in Redis and server URLs, and --raw
parameter values (server extras may hold keys), are masked in every error, log line, status
field and page; everything the monitor page shows from data or servers (consumer names, server
URLs, failure reasons, server messages, parameters) is text."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import orjson
import pytest
from conftest import genq
from faultkit import Consumer, private_redis, sim_kwargs
from pipeline import wait_for
from test_monitor import Monitor

from genq.common.queue.keys import RunKeys

SECRET = "s3cretPW"
# Each runs a script if it is ever parsed as markup; none contains "/" (a consumer's name is
# part of its shard's file name).
NAME = "<img src=x onerror=window.__pwned=1>"
MARKER = "<img src=y onerror=window.__pwned=2>"
PATH = "<img src=z onerror=window.__pwned=3>"
# A --raw parameter's name (no "=" in it: --raw splits at the first); its value is a secret.
PARAM = "<script>window.__pwned++</script>"
ROW_ID = "<script>window.__pwned=5</script>"


class PrefixFront(ThreadingHTTPServer):
    """A real HTTP server in front of the simulator that serves it under any path prefix
    (the prefix here is markup), the way a reverse proxy might."""

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = httpx.Client(base_url=upstream, timeout=60)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.upstream.close()


class _Handler(BaseHTTPRequestHandler):
    server: PrefixFront
    protocol_version = "HTTP/1.1"

    def _pass(self) -> None:
        # The SGLang endpoint is the path's tail after the prefix (the consumer asks /health too).
        cut = max(self.path.rfind(tail) for tail in ("/v1/", "/get_", "/health"))
        length = int(self.headers.get("Content-Length") or 0)
        answer = self.server.upstream.request(
            self.command, self.path[cut:], content=self.rfile.read(length) if length else None,
            headers={"content-type": "application/json"})
        self.send_response(answer.status_code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer.content)))
        self.end_headers()
        self.wfile.write(answer.content)

    do_GET = do_POST = _pass  # noqa: N815

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.mark.parametrize("command", [["status"], ["produce", "--once"], ["consume"]])
def test_a_wrong_password_is_never_printed(tmp_path, run_name, command):
    (tmp_path / "d.jsonl").write_text('{"prompt": "hi"}\n')
    args = {"produce": [str(tmp_path / "d.jsonl")],
            "consume": ["--server", "http://127.0.0.1:9", "--out", str(tmp_path)]}
    with private_redis("--requirepass", "right") as server:
        url = server.url.replace("redis://", f"redis://:{SECRET}@")
        proc = genq(*command, *args.get(command[0], []), redis_url=url, run=run_name,
                    check=False, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert SECRET not in out
    assert "redis://:***@127.0.0.1" in out
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # one clear line


def test_monitor_page_shows_untrusted_text_as_text_and_no_secret(
        tmp_path, redis_url, r, run_name, sim_factory):
    rows = [{"id": ROW_ID, "prompt": f"prompt {i}" + (f" {MARKER}" if i < 3 else "")}
            for i in range(200)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    genq("produce", str(data), "--once", "--max-tokens", "50", "--raw", f"{PARAM}={SECRET}",
         redis_url=redis_url, run=run_name)
    # The simulator refuses rows with the marker, quoting it: a server message with markup.
    sim = sim_factory(**sim_kwargs(0.5), bad_marker=MARKER)
    # Some 503s: tasks given back with the server's URL (and its password) in their reason.
    httpx.post(sim.url + "/_sim/faults", json={"error_rate": 0.05}).raise_for_status()
    front = PrefixFront(sim.url)
    port = front.server_address[1]
    server_url = f"http://gpu:{SECRET}@127.0.0.1:{port}/{PATH}"
    consumer = Consumer(redis_url, run_name, server_url, tmp_path / "out", "--poll", "0.05",
                        name=NAME)
    monitor = Monitor(redis_url, run_name, tmp_path, interval=0.2)
    shown: list[str] = []
    try:
        page_text, page_html, pwned, foreign = read_page(monitor)  # while the consumer works
        assert consumer.wait(120) == 0, consumer.log()[-3000:]
        shown += [monitor.get(p)[1].decode() for p in ("/api/status", "/metrics")]
        shown.append(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
        shown.append(genq("status", redis_url=redis_url, run=run_name).stdout)
        consumer_log = consumer.log()
        shown.append(consumer_log)
        wait_for(monitor.progress.exists, what="progress file")
        shown.append(monitor.progress.read_text())
    finally:
        consumer.cleanup()
        monitor_log = monitor.stop()
        front.close()
    shown.append(monitor_log)
    assert pwned is None, "a script from the data ran in the page"
    assert foreign == 0, "markup from the data became elements in the page"
    for text in [page_html, page_text, *shown]:
        assert SECRET not in text
    assert f"http://gpu:***@127.0.0.1:{port}/{PATH}" in page_text  # literally, masked
    assert NAME in page_text  # the consumer's name, as text
    assert PARAM in page_text  # a --raw parameter's name, as text; its value masked
    status = orjson.loads(shown[2])
    assert status["params"][PARAM] == "***"
    assert status["params_history"][0]["changes"][PARAM] == "***"
    assert status["failed"] == 3
    # What rq and rq-dashboard show (job results, the failed registry) and the reasons genq
    # keeps come from Redis: no password there either.
    stored = b"".join(redis_values(r, "rq:*") + redis_values(r, RunKeys(run_name).errors))
    assert b"HTTP 503" in stored + consumer_log.encode()
    assert SECRET.encode() not in stored


def redis_values(r, pattern: str) -> list[bytes]:
    out = []
    for key in r.scan_iter(match=pattern):
        kind = r.type(key)
        if kind == b"hash":
            out += [k + v for k, v in r.hgetall(key).items()]
        elif kind == b"string":
            out.append(r.get(key) or b"")
        elif kind == b"list":
            out += r.lrange(key, 0, -1)
        elif kind in (b"set", b"zset"):
            out += list(r.smembers(key)) if kind == b"set" else r.zrange(key, 0, -1)
        elif kind == b"stream":
            out += [repr(entry).encode() for entry in r.xrange(key)]
    return out


def read_page(monitor: Monitor) -> tuple[str, str, object, int]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        with contextlib.closing(browser):
            page = browser.new_page()
            page.goto(monitor.url + "/")
            # The servers table names the live consumer (from its heartbeat).
            page.wait_for_function("document.getElementById('servers').innerText"
                                   ".includes('onerror')", timeout=60_000)
            # One more refresh of every part of the page: the page's tick marks the body loaded
            # once it has rendered (or failed), so unmark it and wait for the next tick's mark.
            page.evaluate("document.body.dataset.loaded = '0'")
            page.wait_for_function("document.body.dataset.loaded === '1'", timeout=30_000)
            pwned = page.evaluate("window.__pwned")
            # The page's own markup has no <img> and exactly one <script>.
            foreign = page.evaluate(
                "document.querySelectorAll('img').length"
                " + document.querySelectorAll('script').length - 1")
            return page.inner_text("body"), page.content(), pwned, foreign

