"""genq reads what real SGLang 0.5.23 sends (answers kept in tests/data/sglang-0.5.23), and a
consumer never accepts an answer that is not a finished result: an aborted one is run again
without spending an attempt, one with no finish reason spends an attempt each time."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import orjson
import pytest
from faultkit import Consumer, check_truth, produce_once
from pipeline import ConsumerProcess, wait_for, write_dataset
from sim_fixtures import SimProcess, sim_flags

from genq.common.errors import (
    BadTask,
    Retryable,
    ServerAborted,
    ServerUnavailable,
    TryAgain,
    classify,
)
from genq.common.queue.keys import RunKeys
from genq.common.queue.run import failure_reasons
from genq.common.report.status import read_status
from genq.common.sglang.stream import (
    Answer,
    ContextExceeded,
    error_message,
    load_moved,
    parse_load,
    split_thinking,
    status_error,
    whole_answer,
)

REAL = Path(__file__).parent / "data" / "sglang-0.5.23"
URL = "http://gpu0:30000"


def real(name: str):
    return orjson.loads((REAL / name).read_bytes())


def test_load_and_capacity_from_real_v1_loads():
    # The KV figures are the real server's: a 65,536-token pool, idle.
    assert parse_load(real("v1_loads.json")) == {
        "num_reqs": 0, "num_waiting_reqs": 0, "max_running_requests": 16,
        "num_used_tokens": 0, "max_total_num_tokens": 65536, "token_usage": 0.0,
        "gen_throughput": 0.0}
    busy = {"loads": [{"num_running_reqs": 16, "num_waiting_reqs": 0, "num_used_tokens": 1500,
                       "max_total_num_tokens": 65536, "max_running_requests": 16,
                       "gen_throughput": 812.5}] * 2}  # two DP ranks add up
    assert parse_load(busy)["token_usage"] == round(3000 / 131072, 4)
    assert parse_load(busy)["gen_throughput"] == 1625.0
    info = real("get_server_info.json")
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 16
    assert real("v1_models.json")["data"][0]["max_model_len"] == 8192


def test_a_real_streamed_answer_is_read_whole():
    answer = Answer()
    lines = (REAL / "stream_parser_thinking.txt").read_bytes().strip().splitlines()
    ended = [answer.feed(line, 7, URL) for line in lines]
    assert ended[-1] and not any(ended[:-1])
    done = answer.completion(URL, thinking=True)
    assert done.finish_reason == "length" and done.content == ""
    assert done.reasoning_content == " sudeltakipFArror\ufffd unt\ufffd\u0015licitiss\ufffd"
    assert (done.prompt_tokens, done.completion_tokens) == (15, 12)


def test_a_real_whole_answer_reads_as_its_stream_does():
    whole = whole_answer((REAL / "chat_parser_thinking.json").read_bytes(), URL, thinking=True)
    assert whole.finish_reason == "length" and whole.content == ""
    assert whole.reasoning_content and whole.completion_tokens == 12
    stop = whole_answer((REAL / "chat_stop.json").read_bytes(), URL, thinking=False)
    assert stop.finish_reason == "stop" and stop.reasoning_content is None and stop.content
    for broken in (b"{}", b'{"choices": []}', b"not json"):
        with pytest.raises(ServerUnavailable, match="malformed answer"):
            whole_answer(broken, URL, thinking=True)
    aborted = {"choices": [{"message": {"content": "x"}, "finish_reason": "abort"}]}
    with pytest.raises(ServerAborted):
        whole_answer(orjson.dumps(aborted), URL, thinking=True)


def test_a_load_moves_with_work_that_changes_not_with_a_queue():
    idle = parse_load(real("v1_loads.json"))
    busy = {**idle, "num_reqs": 4, "num_used_tokens": 900, "gen_throughput": 80.0}
    assert not load_moved(idle, idle)
    assert load_moved(idle, busy) and load_moved(busy, {**busy, "num_used_tokens": 950})
    assert not load_moved(busy, busy)  # a frozen server answers the same figures
    assert not load_moved(busy, {**busy, "num_waiting_reqs": 2})  # a frozen server keeps its queue


def test_the_real_context_length_400_lowers_max_tokens_and_is_never_a_bad_task():
    message = error_message((REAL / "context_400.json").read_bytes())
    error = status_error(400, message, 7, URL)
    assert isinstance(error, ContextExceeded)
    assert (error.context, error.input_tokens) == (8192, 15)
    assert classify(error) is TryAgain
    too_long = status_error(
        400, "The input (9000 tokens) is longer than the model's context length (8192 tokens).",
        7, URL)
    assert classify(too_long) is TryAgain
    assert classify(status_error(400, "temperature must be >= 0", 7, URL)) is BadTask
    assert classify(status_error(503, "", 7, URL)) is Retryable
    assert error_message(b'{"detail":"Not Found"}') == "Not Found"


@pytest.mark.parametrize("finish, verdict", [("abort", ServerAborted), (None, TryAgain),
                                             ("content_filter", TryAgain)])
def test_no_finished_result_is_never_accepted(finish, verdict):
    answer = Answer()
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": finish}]}
    answer.feed(b"data: " + orjson.dumps(chunk), 0, URL)
    answer.feed(b"data: [DONE]", 0, URL)
    with pytest.raises(verdict):
        answer.completion(URL, thinking=True)
    cut = Answer()
    cut.feed(b"data: " + orjson.dumps(chunk), 0, URL)
    with pytest.raises(ServerUnavailable):  # no [DONE]: the connection broke
        cut.completion(URL, thinking=True)


def test_thinking_is_where_it_belongs_in_all_three_cases():
    # 1. no --reasoning-parser: the thinking is in content, split off by genq
    assert split_thinking("<think>\nplan it\n</think>\n\nThe answer.") == (
        "plan it", "The answer.")
    assert split_thinking("plan it</think>The answer.") == ("plan it", "The answer.")
    # 2. never closed: all of it is thinking, the answer is empty (as the qwen3 parser does)
    assert split_thinking("<think>still thinking") == ("still thinking", "")
    # 3. no thinking at all (or a server that already split it): content untouched
    assert split_thinking("Just the answer.") == (None, "Just the answer.")


def sim_fault(sim, **body) -> None:
    httpx.post(sim.url + "/_sim/faults", json=body, timeout=5).raise_for_status()


def test_aborted_answers_come_back_without_spending_an_attempt(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 20
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(time_scale=20, length_dist="fixed:50", max_running_requests=4)
    sim_fault(sim, finish="abort")
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "1")
    try:
        wait_for(lambda: "finish_reason abort" in c.log(), what="an aborted answer")
        sim_fault(sim, finish=None)
        assert c.wait(90) == 0, c.log()[-3000:]
        events = c.events()
    finally:
        c.cleanup()
    assert any("finish_reason abort" in str(e.get("error", "")) for e in events)
    figures = check_truth(r, redis_url, run_name, n, tmp_path)
    assert figures["failed"] == 0


def test_answers_without_a_finish_reason_spend_attempts_and_fail_with_the_reason(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 4
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(time_scale=50, length_dist="fixed:20")
    sim_fault(sim, finish="missing")
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--max-attempts", "2")
    try:
        assert c.wait(90) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    k = RunKeys(run_name)
    assert r.bitcount(k.failed) == n and not r.bitcount(k.done)
    reasons = set(failure_reasons(r, k, range(n)))
    assert all("gave up after N attempts" in x and "finish_reason None" in x for x in reasons)
    assert httpx.get(sim.url + "/_sim/stats").json()["completed"] == 2 * n


def test_a_warming_server_is_waited_for(
        tmp_path, redis_url, r, run_name):
    n = 6
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = SimProcess(*sim_flags(max_running_requests=4, warmup=4,
                                time_scale=20, length_dist="fixed:30"))
    with pytest.raises(TimeoutError):  # /health says 503 for the first 4 s
        sim.start(timeout=1)
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "out", "--server-wait", "60",
                        "--poll", "0.05", "--grace", "2")
    try:
        k = RunKeys(run_name)
        wait_for(lambda: r.bitcount(k.done) == n, timeout=60, what="all done")
        rows = wait_for(lambda: [s for s in read_status(r, run_name)["servers"]
                                 if s.get("load")], timeout=30, what="the server's load")
        c.signal(signal.SIGTERM)
        assert c.wait(30) == 0, c.log()[-3000:]
        events = c.events()
    finally:
        c.cleanup()
        sim.cleanup()
    waits = [e for e in events if e.get("event") == "waiting_for_server"]
    assert waits and "HTTP 503" in waits[0]["error"]
    assert rows[0]["capacity"] == 4


@pytest.mark.parametrize("bad", [2**31, -1])
def test_token_ids_outside_int32_are_refused_when_they_arrive(bad):
    """The export keeps ids as int32: one past it is a broken answer, refused on arrival (the
    task goes back without spending an attempt), never a record that fails the export."""
    answer = real("chat_stop.json")
    choice = answer["choices"][0]
    good = {**answer, "choices": [{**choice, "prompt_token_ids": [1, 2**31 - 1],
                                   "response_token_ids": [5, 2]}]}
    done = whole_answer(orjson.dumps(good), URL, thinking=False)
    assert (done.completion_token_ids, done.matched_stop) == ([5, 2], 2)
    broken = {**answer, "choices": [{**choice, "prompt_token_ids": [1],
                                     "response_token_ids": [5, bad]}]}
    with pytest.raises(ServerUnavailable, match=f"token id {bad} outside 0..2147483647") as e:
        whole_answer(orjson.dumps(broken), URL, thinking=False)
    assert "\n" not in str(e.value) and classify(e.value) is Retryable
