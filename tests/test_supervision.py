"""Housekeeping duties (lease renewal, heartbeat, following the server...) are supervised: one
that dies of an error that is not Redis trouble is logged with its traceback and the consumer
stops, giving its tasks back, instead of acking on with no heartbeat, reaper or parameter
watch."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from faultkit import Consumer, check_truth, owners, produce_once, sim_kwargs
from pipeline import write_dataset

from genq.common.queue.keys import RunKeys

# What a server in trouble may answer on /v1/models once the consumer runs: a context length
# that is not a number. (A null field in /v1/loads or /get_load, the first example, is
# now read as "load unknown" by the client itself, so it no longer kills anything.)
BAD_MODELS = b'{"object": "list", "data": [{"id": "m", "max_model_len": "8k"}]}'
GOOD_MODEL_ANSWERS = 2  # the consumer's start-up reads /v1/models twice (model, context)


class BadModelsFront(ThreadingHTTPServer):
    """A real HTTP server in front of the simulator: after start-up, /v1/models answers with a
    context length that is not a number; everything else is passed through."""

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = httpx.Client(base_url=upstream, timeout=60)
        self.models_answers = 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.upstream.close()


class _Handler(BaseHTTPRequestHandler):
    server: BadModelsFront
    protocol_version = "HTTP/1.1"

    def _pass(self) -> None:
        if self.path == "/v1/models":
            self.server.models_answers += 1
        if self.path == "/v1/models" and self.server.models_answers > GOOD_MODEL_ANSWERS:
            status, body = 200, BAD_MODELS
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
    front = BadModelsFront(sim.url)
    consumer = Consumer(redis_url, run_name, front.url, tmp_path / "a")
    try:
        rc = consumer.wait(60)
        events = consumer.events()
    finally:
        consumer.cleanup()
        front.close()
    crashed = [e for e in events if e.get("event") == "background_task_crashed"]
    assert rc == 1, f"rc {rc}: a dead housekeeping task went unnoticed"
    assert [e["task"] for e in crashed] == ["follow_server"]  # the duty that read /v1/models
    assert "ValueError" in crashed[0]["exception"]  # the traceback is in the log line
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
