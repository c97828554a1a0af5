"""The simulator behaves like SGLang where genq relies on it: shapes, limits, queueing, faults."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import httpx
import orjson
import pytest
from conftest import REPO

from genq.simulator.model import natural_length
from genq.simulator.settings import parse_length_dist

pytest_plugins = ["sim_fixtures"]

FAST = {"time_scale": 1000, "length_dist": "fixed:100"}


def chat(url: str, text: str, timeout: float = 10, **body) -> httpx.Response:
    payload = {"model": "m", "messages": [{"role": "user", "content": text}], **body}
    return httpx.post(url + "/v1/chat/completions", json=payload, timeout=timeout)


def stats(url: str) -> dict:
    return httpx.get(url + "/_sim/stats", timeout=5).json()


def wait_for(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def raw_chat(port: int, text: str, max_tokens: int = 10) -> socket.socket:
    """Send a chat request on a bare socket, so the test can hang up whenever it likes."""
    body = orjson.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
        b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    return sock


def test_chat_response_has_sglang_shape(sim_factory):
    sim = sim_factory(reasoning_parser="qwen3", **FAST)
    r = chat(sim.url, "write a haiku about queues", max_tokens=500)
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "chat.completion" and data["id"] and data["created"] > 0
    choice = data["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["matched_stop"] == 151645
    message = choice["message"]
    assert message["role"] == "assistant"
    # 100 ids: <think>, a newline, 66 words, a newline, </think>, a blank line, 28 words,
    # <|im_end|>: Qwen3's `<think>\n...\n</think>\n\n`, as its template renders the turn again.
    assert len(message["reasoning_content"].split()) == 66
    assert len(message["content"].split()) == 28
    usage = data["usage"]
    assert usage["completion_tokens"] == 100 and usage["reasoning_tokens"] == 70
    assert usage["prompt_tokens"] == 5 + 8  # the words in the chat template's 8 ids
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_info_endpoints(sim_factory):
    sim = sim_factory(max_running_requests=7, model="qwen-sim", **FAST)
    assert httpx.get(sim.url + "/health").status_code == 200
    info = httpx.get(sim.url + "/get_model_info").json()
    assert info["model_path"] == "qwen-sim" and info["is_generation"] is True
    server = httpx.get(sim.url + "/get_server_info").json()
    assert server["max_running_requests"] == 7 and server["version"] == "0.5.23-sim"
    [rank] = httpx.get(sim.url + "/v1/loads").json()["loads"]
    assert (rank["num_running_reqs"], rank["num_waiting_reqs"]) == (0, 0)
    assert rank["max_running_requests"] == 7
    models = httpx.get(sim.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "qwen-sim"
    chat(sim.url, "count me", max_tokens=500)
    metrics = httpx.get(sim.url + "/metrics").text
    assert 'sglang:generation_tokens_total{model_name="qwen-sim"} 100.0' in metrics
    for name in ("num_running_reqs", "num_queue_reqs", "prompt_tokens_total"):
        assert f"sglang:{name}" in metrics
    missing = httpx.get(sim.url + "/nope")
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}


def test_lengths_are_deterministic_per_prompt_and_seed(sim_factory):
    a = sim_factory(time_scale=1000, seed=3, length_dist="lognormal:300:0.6")
    b = sim_factory(time_scale=1000, seed=3, length_dist="lognormal:300:0.6")
    prompts = [f"prompt number {i}" for i in range(8)]

    def lengths(url: str) -> list[int]:
        return [
            chat(url, p, max_tokens=10_000).json()["usage"]["completion_tokens"] for p in prompts
        ]

    first = lengths(a.url)
    assert first == lengths(a.url) == lengths(b.url)
    assert len(set(first)) > 1


def test_default_length_dist_matches_the_real_run():
    dist = parse_length_dist("lognormal:2326:0.62")
    lengths = sorted(natural_length(f"row {i}", 0, dist) for i in range(4000))
    truncated = sum(n > 4096 for n in lengths) / len(lengths)
    assert 0.15 < truncated < 0.21
    assert 2150 < lengths[len(lengths) // 2] < 2500


def test_length_finish_and_higher_limit_lets_it_finish(sim_factory):
    sim = sim_factory(reasoning_parser="qwen3", **FAST)
    cut = chat(sim.url, "long answer", max_tokens=80).json()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["matched_stop"] is None
    assert cut["usage"]["completion_tokens"] == 80
    assert len(cut["choices"][0]["message"]["content"].split()) == 9  # after 71 ids and \n\n
    full = chat(sim.url, "long answer", max_completion_tokens=101).json()
    assert full["choices"][0]["finish_reason"] == "stop"
    assert full["usage"]["completion_tokens"] == 100


def test_cut_inside_thinking_has_empty_content(sim_factory):
    sim = sim_factory(reasoning_parser="qwen3", **FAST)
    message = chat(sim.url, "think hard", max_tokens=50).json()["choices"][0]["message"]
    assert message["content"] == ""
    assert len(message["reasoning_content"].split()) == 48  # after <think> and its newline
    no_think = chat(
        sim.url, "think hard", max_tokens=500, chat_template_kwargs={"enable_thinking": False}
    ).json()
    assert no_think["choices"][0]["message"]["reasoning_content"] is None
    # 100 ids: 99 words and <|im_end|>
    assert len(no_think["choices"][0]["message"]["content"].split()) == 99


def test_generate_defaults_to_128_new_tokens(sim_factory):
    sim = sim_factory(time_scale=1000, length_dist="fixed:500")
    r = httpx.post(sim.url + "/generate", json={"text": "hi", "sampling_params": {}})
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 128
    r = httpx.post(
        sim.url + "/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 600}},
    )
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "stop" and meta["completion_tokens"] == 500
    assert meta["prompt_tokens"] == 3 and r.json()["text"].startswith("<think>")


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "x __GENQ_BAD__ y"}], "max_tokens": 10},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10, "temperature": -1},
        {"messages": [], "max_tokens": 10},
        {"max_tokens": 10},
    ],
)
def test_bad_requests_get_400(sim_factory, body):
    sim = sim_factory(**FAST)
    for _ in range(2):
        r = httpx.post(sim.url + "/v1/chat/completions", json=body)
        assert r.status_code == 400
        err = r.json()
        assert err["object"] == "error" and err["code"] == 400 and err["message"]
        # SGLang's request model (pydantic) says "Bad Request"; its own checks BadRequestError.
        pydantic = "messages" not in body or not body["messages"]
        assert err["type"] == ("Bad Request" if pydantic else "BadRequestError")
    r = httpx.post(sim.url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400


def test_max_running_enforced_and_load_shows_the_queue(sim_factory):
    sim = sim_factory(max_running_requests=8, time_scale=5, length_dist="fixed:50")
    seen: list[dict] = []

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=sim.url, timeout=30, limits=limits) as client:

            async def poll() -> None:
                while True:
                    seen.append((await client.get("/v1/loads")).json()["loads"][0])
                    await asyncio.sleep(0.02)

            poller = asyncio.create_task(poll())
            calls = [
                client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 100},
                )
                for i in range(60)
            ]
            codes = [r.status_code for r in await asyncio.gather(*calls)]
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
            return codes

    assert asyncio.run(main()) == [200] * 60
    assert max(load["num_running_reqs"] for load in seen) == 8
    assert any(load["num_running_reqs"] == 8 and load["num_waiting_reqs"] > 0 for load in seen)
    final = stats(sim.url)
    assert final["max_running_seen"] == 8 and final["completed"] == 60


def test_client_disconnect_frees_its_slot(sim_factory):
    sim = sim_factory(max_running_requests=1, ttft=60, length_dist="fixed:10")
    first = raw_chat(sim.port, "first")
    wait_for(lambda: stats(sim.url)["running"] == 1)
    second = raw_chat(sim.port, "second")
    third = raw_chat(sim.port, "third")
    wait_for(lambda: stats(sim.url)["waiting"] == 2)
    third.close()  # leaving while queued takes it out of the queue
    wait_for(lambda: stats(sim.url)["waiting"] == 1)
    first.close()  # leaving while running hands the slot to the next in line at once
    wait_for(lambda: stats(sim.url)["waiting"] == 0)
    s = stats(sim.url)
    assert s["running"] == 1 and s["aborted"] == 2 and s["completed"] == 0
    second.close()
    wait_for(lambda: stats(sim.url)["running"] == 0)
    assert stats(sim.url)["aborted"] == 3


def test_sigterm_with_requests_in_flight_exits_cleanly(sim_factory):
    sim = sim_factory(ttft=60)
    socks = [raw_chat(sim.port, f"q{i}") for i in range(5)]
    wait_for(lambda: stats(sim.url)["running"] == 5)
    sim.stop()
    for sock in socks:
        sock.close()
    assert sim.returncode == 0
    assert "sim_listening" in sim.log() and "Traceback" not in sim.log()


def test_runtime_status_fault_then_normal(sim_factory):
    sim = sim_factory(**FAST)
    started = time.monotonic()
    set_fault = httpx.post(sim.url + "/_sim/faults", json={"status": 500, "for_s": 1})
    assert set_fault.status_code == 200 and set_fault.json()["status"] == 500
    r = chat(sim.url, "x", max_tokens=10)
    assert r.status_code == 500 and r.json()["object"] == "error"
    assert httpx.get(sim.url + "/health").status_code == 200
    # The fault lifts by itself after its second: the simulator says so, then answers.
    wait_for(lambda: httpx.get(sim.url + "/_sim/faults").json()["status"] is None, timeout=10)
    assert 1.0 <= time.monotonic() - started < 3.0
    assert chat(sim.url, "x", max_tokens=10).status_code == 200
    assert stats(sim.url)["fault_errors"] == 1
    assert httpx.post(sim.url + "/_sim/faults", json={"bogus": 1}).status_code == 400


def test_runtime_hang_and_reset_faults(sim_factory):
    sim = sim_factory(**FAST)
    httpx.post(sim.url + "/_sim/faults", json={"hang": True, "for_s": 30})
    with pytest.raises(httpx.ReadTimeout):
        chat(sim.url, "x", max_tokens=10, timeout=0.3)
    httpx.post(sim.url + "/_sim/faults", json={"hang": False, "reset": True})
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        chat(sim.url, "x", max_tokens=10)
    httpx.post(sim.url + "/_sim/faults", json={"clear": True})
    assert chat(sim.url, "x", max_tokens=10).status_code == 200
    wait_for(lambda: stats(sim.url)["aborted"] == 1)
    s = stats(sim.url)
    assert s["hung"] == 1 and s["resets"] == 1 and s["completed"] == 1


def test_stall_fault_freezes_decoding_and_the_queue_until_it_ends(sim_factory):
    # Requests of ~1.1 s, one at a time: stalled for longer than one takes, none finishes
    # and the load stands still; once the stall ends, all finish.
    sim = sim_factory(max_running_requests=1, length_dist="fixed:50")
    socks = [raw_chat(sim.port, f"q{i}", max_tokens=100) for i in range(3)]
    wait_for(lambda: stats(sim.url)["waiting"] == 2)
    httpx.post(sim.url + "/_sim/faults", json={"stall": True}).raise_for_status()
    first = httpx.get(sim.url + "/v1/loads").json()["loads"][0]
    time.sleep(1.5)
    assert {**httpx.get(sim.url + "/v1/loads").json()["loads"][0], "timestamp": 0} == {
        **first, "timestamp": 0}
    assert stats(sim.url)["completed"] == 0 and first["num_waiting_reqs"] == 2
    assert httpx.get(sim.url + "/_sim/faults").json()["stall_left_s"] > 0
    httpx.post(sim.url + "/_sim/faults", json={"stall": False}).raise_for_status()
    wait_for(lambda: stats(sim.url)["completed"] == 3)
    for sock in socks:
        sock.close()


def test_error_rate_flag_answers_503(sim_factory):
    sim = sim_factory(error_rate=1, **FAST)
    r = chat(sim.url, "x", max_tokens=10)
    assert r.status_code == 503 and r.json()["type"] == "ServiceUnavailableError"


def test_many_concurrent_requests_complete(sim_factory):
    sim = sim_factory(time_scale=1000, length_dist="fixed:50")

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(base_url=sim.url, timeout=60, limits=limits) as client:
            calls = [
                client.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": f"short {i}"}],
                        "max_tokens": 64,
                    },
                )
                for i in range(300)
            ]
            return [r.status_code for r in await asyncio.gather(*calls)]

    assert asyncio.run(main()) == [200] * 300
    assert stats(sim.url)["completed"] == 300


def test_bad_flag_exits_2_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "genq.simulator", "--length-dist", "gamma:1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--length-dist" in proc.stderr
