"""Background tasks (lease renewal, housekeeping) are supervised: one that dies of an error
that is not Redis trouble is logged with its traceback and the consumer stops, giving its
tasks back, instead of acking on with no heartbeat, reaper or parameter watch."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from faultkit import Consumer, check_truth, owners, produce_once, sim_kwargs
from pipeline import write_dataset

from common.keys import RunKeys

# What a server in trouble may answer on /get_load: a rank with a null count.
NULL_LOAD = b'[{"dp_rank": 0, "num_reqs": null, "num_waiting_reqs": 0, "num_tokens": 0}]'


class NullLoadFront(ThreadingHTTPServer):
    """A real HTTP server in front of the simulator: /get_load answers with a null field,
    everything else is passed through."""

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = httpx.Client(base_url=upstream, timeout=60)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.upstream.close()


class _Handler(BaseHTTPRequestHandler):
    server: NullLoadFront
    protocol_version = "HTTP/1.1"

    def _pass(self) -> None:
        if self.path == "/get_load":
            status, body = 200, NULL_LOAD
        else:
            length = int(self.headers.get("Content-Length") or 0)
            answer = self.server.upstream.request(
                self.command, self.path, content=self.rfile.read(length) if length else None,
                headers={"content-type": self.headers.get("content-type", "application/json")})
            status, body = answer.status_code, answer.content
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _pass  # noqa: N815

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def test_housekeeping_crash_is_logged_and_stops_the_consumer(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 80
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.5))
    front = NullLoadFront(sim.url)
    consumer = Consumer(redis_url, run_name, front.url, tmp_path / "a")
    try:
        rc = consumer.wait(60)
        events = consumer.events()
    finally:
        consumer.cleanup()
        front.close()
    crashed = [e for e in events if e.get("event") == "background_task_crashed"]
    assert rc == 1, f"rc {rc}: a dead housekeeping task went unnoticed"
    assert [e["task"] for e in crashed] == ["housekeeping"]
    assert "TypeError" in crashed[0]["exception"]  # the traceback is in the log line
    assert "Traceback" in crashed[0]["exception"]
    assert owners(r, run_name) == {}, "the stopped consumer gives its leases back"
    done = r.bitcount(RunKeys(run_name).done)
    assert done < n, "it stopped at the crash instead of running the whole run"

    # A consumer on a healthy server finishes the run: nothing lost, nothing counted twice.
    fine = Consumer(redis_url, run_name, sim_factory(**sim_kwargs(0.05)).url, tmp_path / "b",
                    concurrency=16)
    try:
        assert fine.wait(120) == 0, fine.log()[-3000:]
    finally:
        fine.cleanup()
    check_truth(r, redis_url, run_name, n, tmp_path)
