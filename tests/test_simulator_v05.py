"""The simulator models SGLang 0.5.23 where real servers differ from older ones: capacity
reported only in /v1/loads unless launched with --max-running-requests, /get_load gone, the
context length and its two 400s, max_tokens 0, /health 503 while warming up, thinking left in
content without --reasoning-parser, and `stream: true` answers."""

from __future__ import annotations

import httpx
import orjson
import pytest
from conftest import wait_port
from sim_fixtures import SimProcess, sim_flags
from test_simulator import FAST, chat, stats, wait_for

pytest_plugins = ["sim_fixtures"]


def stream(url: str, text: str, **body) -> tuple[httpx.Response, list[dict | str]]:
    """A streamed chat answer as its list of events (dicts, and the final "[DONE]")."""
    payload = {"messages": [{"role": "user", "content": text}], "stream": True, **body}
    events: list[dict | str] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=payload, timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else orjson.loads(data))
    return r, events


def joined(events: list, field: str) -> str | None:
    parts = [e["choices"][0]["delta"].get(field) for e in events if isinstance(e, dict)
             and e["choices"]]
    texts = [p for p in parts if p is not None]
    return "".join(texts) if texts else None


def test_capacity_is_null_in_server_info_unless_given_and_loads_tell_it(sim_factory):
    sim = sim_factory(effective_max_running=5, **FAST)
    info = httpx.get(sim.url + "/get_server_info").json()
    assert info["max_running_requests"] is None
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 5
    assert httpx.get(sim.url + "/v1/loads").json()["loads"][0]["max_running_requests"] == 5
    assert httpx.get(sim.url + "/get_load").status_code == 404
    legacy = sim_factory(max_running_requests=3, legacy_get_load=True, **FAST)
    assert httpx.get(legacy.url + "/get_server_info").json()["max_running_requests"] == 3
    assert httpx.get(legacy.url + "/get_load").json()[0]["num_reqs"] == 0
    assert httpx.get(legacy.url + "/v1/loads").status_code == 404


def test_context_length_refusals_are_sglangs(sim_factory):
    sim = sim_factory(context_length=50, **FAST)
    assert httpx.get(sim.url + "/v1/models").json()["data"][0]["max_model_len"] == 50
    # 11 prompt ids: the 3 words in the chat template's 8.
    assert chat(sim.url, "one two three", max_tokens=39).status_code == 200
    total = chat(sim.url, "one two three", max_tokens=40)
    assert total.status_code == 400 and total.json()["type"] == "BadRequestError"
    assert total.json()["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 50 tokens. "
        "You requested a total of 51 tokens: 11 tokens from the input messages and 40 tokens")
    long = chat(sim.url, "word " * 60, max_tokens=1)
    assert long.status_code == 400
    assert long.json()["message"] == (
        "The input (69 tokens) is longer than the model's context length (50 tokens).")


def test_max_tokens_zero_is_an_empty_length_answer(sim_factory):
    sim = sim_factory(**FAST)
    data = chat(sim.url, "x", max_tokens=0).json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["choices"][0]["message"]["content"] == ""
    assert data["usage"]["completion_tokens"] == 0


def test_health_answers_503_while_warming_up():
    sim = SimProcess(*sim_flags(warmup=30, **FAST))
    try:
        with pytest.raises(TimeoutError):
            sim.start(timeout=1.5)
        wait_port(sim.port, timeout=20)
        assert httpx.get(sim.url + "/health").status_code == 503
        assert chat(sim.url, "x", max_tokens=3).status_code == 200
    finally:
        sim.cleanup()


def test_thinking_stays_in_content_without_a_reasoning_parser(sim_factory):
    plain = sim_factory(**FAST)
    whole = chat(plain.url, "q", max_tokens=500).json()["choices"][0]["message"]
    assert whole["reasoning_content"] is None
    assert whole["content"] == "<think>\n" + " ".join(["hmm"] * 66) + "\n</think>\n\n" + \
        " ".join(["ok"] * 28)  # <|im_end|> ends the ids but is no text
    cut = chat(plain.url, "q", max_tokens=20).json()["choices"][0]["message"]
    assert cut["content"] == "<think>\n" + " ".join(["hmm"] * 18)
    parsed = sim_factory(reasoning_parser="qwen3", **FAST)
    cut = chat(parsed.url, "q", max_tokens=20).json()["choices"][0]["message"]
    assert cut["content"] == "" and cut["reasoning_content"] == "\n" + " ".join(["hmm"] * 18)


@pytest.mark.parametrize("parser", [None, "qwen3"])
@pytest.mark.parametrize("max_tokens", [500, 40, 80])
def test_a_streamed_answer_adds_up_to_the_plain_one(sim_factory, parser, max_tokens):
    sim = sim_factory(reasoning_parser=parser, time_scale=50, length_dist="fixed:100")
    plain = chat(sim.url, "same prompt", max_tokens=max_tokens).json()
    r, events = stream(sim.url, "same prompt", max_tokens=max_tokens,
                       stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len(events) > 4  # several decode steps, not one blob
    message = plain["choices"][0]["message"]
    # SGLang 0.5.23's whole answer keeps the blank line after </think> in content; its
    # streamed chunks carry it nowhere (tests/test_chunk_shapes.py, real tier)
    whole = message["content"].removeprefix("\n\n") if parser else message["content"]
    assert (joined(events, "content") or "") == whole
    assert joined(events, "reasoning_content") == (message["reasoning_content"] or None)
    finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    assert finish[-1] == plain["choices"][0]["finish_reason"] and not any(finish[:-1])
    assert events[-2]["choices"] == [] and events[-2]["usage"] == plain["usage"]
    assert events[-1] == "[DONE]"
    _, no_usage = stream(sim.url, "same prompt", max_tokens=max_tokens)
    assert all("usage" not in e for e in no_usage[:-1]) and no_usage[-1] == "[DONE]"


@pytest.mark.parametrize("parser", [None, "qwen3"])
def test_a_chunk_per_token_as_sglang_sends_them(sim_factory, parser):
    """--stream-interval 1 (the default, as SGLang's): one chunk per decoded token, thinking
    in reasoning_content with a parser; the chunks add up to the plain answer."""
    sim = sim_factory(reasoning_parser=parser, time_scale=20, length_dist="fixed:60",
                      stream_interval=1)
    plain = chat(sim.url, "q", max_tokens=50).json()["choices"][0]["message"]
    _, events = stream(sim.url, "q", max_tokens=50)
    texts = [e["choices"][0]["delta"] for e in events[1:-2]]  # between role and finish chunks
    # One token each, in one text field (an answer's chunk also says reasoning_content: null);
    # with a parser the tags and the blank line after </think> are no text, so no chunk
    # (tests/test_chunk_shapes.py: real SGLang 0.5.23's chunks).
    assert len(texts) == (47 if parser else 50)
    assert all(sum(v is not None for v in d.values()) == 1 for d in texts)
    if parser:
        thinking = [d["reasoning_content"] for d in texts if d.get("reasoning_content")]
        # 70 % of 60, less tags: the newline after <think> (and before </think>) is thinking
        assert len(thinking) == 40 and thinking[:3] == ["\n", "hmm", " hmm"]
    whole = plain["content"].removeprefix("\n\n") if parser else plain["content"]
    assert (joined(events, "content") or "") == whole  # the whole answer keeps the blank line
    assert joined(events, "reasoning_content") == (plain["reasoning_content"] or None)


def test_a_simulator_too_slow_for_the_pace_says_so_and_never_merges_chunks(sim_factory):
    sim = sim_factory(time_scale=100_000, length_dist="fixed:3000", stream_interval=1)
    _, events = stream(sim.url, "q", max_tokens=3000)
    # role, a chunk per token but the stop token (no text), finish, [DONE]
    assert len(events) == 1 + 2999 + 2
    assert httpx.get(sim.url + "/_sim/stats").json()["behind_s"] > 0


def test_leaving_a_stream_aborts_the_request(sim_factory):
    sim = sim_factory(time_scale=1, ttft=0, decode_tps=20, length_dist="fixed:2000")
    payload = {"messages": [{"role": "user", "content": "q"}], "stream": True,
               "max_tokens": 2000}
    with httpx.stream("POST", sim.url + "/v1/chat/completions", json=payload) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert stats(sim.url)["running"] == 1
    wait_for(lambda: stats(sim.url)["running"] == 0)
    assert stats(sim.url)["aborted"] == 1 and stats(sim.url)["completed"] == 0


def test_stream_faults_hang_without_headers_and_errors_are_plain(sim_factory):
    sim = sim_factory(**FAST)
    httpx.post(sim.url + "/_sim/faults", json={"hang": True, "for_s": 30})
    payload = {"messages": [{"role": "user", "content": "q"}], "stream": True, "max_tokens": 5}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(sim.url + "/v1/chat/completions", json=payload, timeout=0.5)
    assert stats(sim.url)["hung"] == 1
    httpx.post(sim.url + "/_sim/faults", json={"clear": True, "status": 503})
    r = httpx.post(sim.url + "/v1/chat/completions", json=payload, timeout=5)
    assert r.status_code == 503 and r.json()["object"] == "error"
