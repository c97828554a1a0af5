"""Structured output (`--schema`): the schema goes to the server as its response_format, every
answer is checked against it, an invalid one is asked again with another seed, and a prompt
none of whose answers matched fails naming the violation, its last answer kept. On the
simulator (which breaks a share of answers on purpose) and on a real SGLang, whose grammar
backend enforces the schema."""

from __future__ import annotations

import json

import httpx
import jsonschema
import orjson
import pytest
from conftest import genq
from faultkit import record_figures
from pipeline import ConsumerProcess, read_jsonl, write_dataset
from sglang_servers import start_server

from genq.common.errors import BadTask, SchemaUnusable, UsageError, classify
from genq.common.queue.keys import RunKeys
from genq.common.schema import checker, response_format, violation
from genq.common.task import request_body

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 3},
        "grade": {"enum": ["A", "B", "C"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "grade", "score"],
    "additionalProperties": False,
}


def valid(content) -> bool:
    try:
        jsonschema.validate(orjson.loads(content), SCHEMA)
        return True
    except (orjson.JSONDecodeError, jsonschema.ValidationError):
        return False


@pytest.fixture
def schema_file(tmp_path):
    path = tmp_path / "grade.json"
    path.write_text(json.dumps(SCHEMA))
    return path


def run_to_end(redis_url, run, server, out, timeout=180) -> None:
    c = ConsumerProcess(redis_url, run, server.url, out, "--burst")
    assert c.wait(timeout) == 0
    c.cleanup()


def export(tmp_path, redis_url, run) -> list[dict]:
    out = tmp_path / f"{run}.jsonl"
    genq("export", "--out", str(out), "--include-failed", redis_url=redis_url, run=run)
    return read_jsonl(out)


def test_the_first_violation_is_named_by_its_path():
    check = checker(SCHEMA)
    assert violation('{"name": "abc", "grade": "B", "score": 3}', check) is None
    enum = violation('{"name": "abc", "grade": "Z", "score": 3}', check)
    assert enum is not None and "$.grade" in enum and '["A","B","C"]' in enum
    missing = violation('{"name": "abc", "grade": "A"}', check)
    assert missing is not None and "'score' is a required property" in missing
    nested = violation('{"name": "abc", "grade": "A", "score": 1, "tags": ["x", 2]}', check)
    assert nested is not None and "$.tags[1]" in nested
    assert violation('{"name": "ab', check).startswith("answer is not JSON")
    assert violation(None, check).startswith("answer is not JSON")


def test_a_schema_that_cannot_check_fails_the_prompt_not_the_consumer():
    """A `--raw response_format` is not checked at produce: its unresolvable $ref must reach the
    consumer as one verdict (fail the prompt), never as an error no verdict covers."""
    broken = {"type": "object", "properties": {"g": {"$ref": "#/$defs/nowhere"}}}
    with pytest.raises(SchemaUnusable, match="nowhere") as caught:
        checker(broken)
    assert classify(caught.value) is BadTask
    lax = jsonschema.validators.validator_for(broken)(broken)  # built without the ref check
    with pytest.raises(SchemaUnusable) as caught:
        violation('{"g": 1}', lax)
    assert classify(caught.value) is BadTask


def test_the_schema_goes_to_the_server_as_its_response_format(schema_file, tmp_path):
    fmt = response_format(str(schema_file))
    assert fmt == {"type": "json_schema", "json_schema": {"name": "grade", "schema": SCHEMA}}
    body = request_body([{"role": "user", "content": "x"}],
                        {"max_tokens": 10, "response_format": fmt, "schema_retries": 2}, "m")
    assert body["response_format"] == fmt and "schema_retries" not in body
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "no-such-type"}))
    with pytest.raises(UsageError, match="not a valid JSON Schema"):
        response_format(str(bad))


def test_produce_refuses_a_file_that_is_no_schema(tmp_path, redis_url, run_name):
    data = write_dataset(tmp_path / "d.jsonl", 2)
    (tmp_path / "s.json").write_text("{not json")
    out = genq("produce", str(data), "--once", "--schema", str(tmp_path / "s.json"),
               redis_url=redis_url, run=run_name, check=False)
    assert out.returncode == 2 and "cannot read a JSON document" in out.stderr


@pytest.mark.parametrize("ref", ["#/$defs/nowhere", "other.json#/x",
                                 "https://example.com/remote.json"])
def test_a_ref_that_resolves_nowhere_is_refused_in_one_line(tmp_path, redis_url, r, run_name,
                                                            ref):
    """A consumer cannot resolve it either: accepted, it would fail every prompt that reaches
    it. Refused at produce and at requeue, with no traceback and no run or version made."""
    data = write_dataset(tmp_path / "d.jsonl", 2)
    bad = tmp_path / "ref.json"
    bad.write_text(json.dumps({"type": "object", "$defs": {"grade": {"enum": ["A"]}},
                               "properties": {"g": {"$ref": "#/$defs/grade"},
                                              "h": {"items": {"$ref": ref}}}}))
    out = genq("produce", str(data), "--once", "--schema", str(bad), redis_url=redis_url,
               run=run_name, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and f"$ref {ref!r}" in out.stderr
    assert not r.exists(RunKeys(run_name).params)
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    out = genq("requeue", "--schema", str(bad), redis_url=redis_url, run=run_name, check=False)
    assert out.returncode == 2 and f"$ref {ref!r}" in out.stderr and "Traceback" not in out.stderr
    assert r.get(RunKeys(run_name).params_version) == b"1"


def test_the_simulator_answers_with_an_instance_of_the_schema(sim_factory):
    sim = sim_factory(time_scale=1000, reasoning_parser="qwen3", length_dist="fixed:30")
    fmt = {"type": "json_schema", "json_schema": {"name": "g", "schema": SCHEMA}}

    def ask(seed):
        body = {"messages": [{"role": "user", "content": "grade it"}], "max_tokens": 100,
                "seed": seed, "response_format": fmt}
        r = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=10)
        return r.json()["choices"][0]["message"]["content"]

    answers = [ask(seed) for seed in range(20)]
    assert all(valid(a) for a in answers) and answers[0] == ask(0)  # by prompt and seed
    assert len(set(answers)) > 1
    httpx.post(sim.url + "/_sim/faults", json={"invalid_json_rate": 1.0}, timeout=5)
    assert not any(valid(ask(seed)) for seed in range(20))
    stats = httpx.get(sim.url + "/_sim/stats", timeout=5).json()["json_answers"]
    assert stats == {"valid": 21, "invalid": 20}


@pytest.mark.timeout(300)
def test_invalid_answers_are_asked_again_and_counted(tmp_path, redis_url, r, run_name,
                                                     sim_factory, schema_file):
    """20 % of the answers invalid, one retry each: every exported answer matches, status
    counts exactly what the simulator sent, a prompt fails only when both answers were
    invalid, and a cut answer is truncated, not invalid, and counted as cut."""
    n = 200
    data = write_dataset(tmp_path / "d.jsonl", n)
    sim = sim_factory(time_scale=1000, reasoning_parser="qwen3", invalid_json_rate=0.2,
                      length_dist="lognormal:60:0.6", seed=3)
    genq("produce", str(data), "--once", "--schema", str(schema_file), "--max-tokens", "100",
         "--set", "schema_retries=1", redis_url=redis_url, run=run_name)
    run_to_end(redis_url, run_name, sim, tmp_path / "out")
    sent = httpx.get(sim.url + "/_sim/stats", timeout=5).json()["json_answers"]
    records = export(tmp_path, redis_url, run_name)
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)

    record_figures("schema_sim", sent=sent, schema=status["schema"], failed=status["failed"])
    done = [rec for rec in records if rec.get("status") != "failed"]
    failed = [rec for rec in records if rec.get("status") == "failed"]
    answered = [rec for rec in done if rec["finish_reason"] == "stop"]
    cut = [rec for rec in done if rec["finish_reason"] == "length"]
    assert len(records) == n and answered and cut and len(failed) > 1
    assert all(valid(rec["content"]) for rec in answered)
    assert not any(valid(rec["content"]) for rec in cut)  # kept as cut, not asked again
    # A cut answer is not JSON: status counts those too, in --json and in its table.
    assert status["schema"] == {"1": {"invalid": sent["invalid"], "failed": len(failed),
                                      "cut": sent["cut"]}}
    table = " ".join(genq("status", redis_url=redis_url, run=run_name).stdout.split())
    assert f"{sent['cut']} answers cut at max_tokens (not JSON)" in table, table
    assert status["failed"] == len(failed) and status["truncated"] == len(cut) == sent["cut"]
    # A valid answer was accepted every time: no prompt failed that a retry made valid.
    assert sent["valid"] == len(answered)
    # Each failed prompt's two answers were invalid; the other invalid ones were retried.
    assert sent["invalid"] >= 2 * len(failed) and sent["invalid"] > len(failed)
    # Most were made valid by their retry: it had another seed (the same one draws the same).
    assert sent["invalid"] - 2 * len(failed) > len(failed)
    for rec in failed:
        assert rec["error"].startswith("answer ") and "2 answers, none matched" in rec["error"]
        answer = rec["answer"]
        assert answer["params_version"] == 1 and not valid(answer["content"])
        assert rec["error"].startswith(answer["violation"].split(" (char")[0].split(": line")[0])
    # Thinking apart: the reasoning is kept beside the structured content.
    assert all(rec["reasoning_content"] for rec in answered)


def test_requeue_schema_is_a_new_version(tmp_path, redis_url, r, run_name, schema_file):
    data = write_dataset(tmp_path / "d.jsonl", 3)
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    genq("requeue", "--schema", str(schema_file), redis_url=redis_url, run=run_name)
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    assert status["params_version"] == 2
    assert status["params_history"][-1]["changes"]["response_format"][0] is None
    params = orjson.loads(r.hget(f"genq:{run_name}:params", "2"))
    assert params["response_format"]["json_schema"]["schema"] == SCHEMA


@pytest.mark.real_sglang
def test_real_sglang_enforces_the_schema(tmp_path, redis_url, r, run_name):
    """SGLang 0.5.23's CPU build decodes under its grammar backend (xgrammar): with thinking
    off the tiny random model's answers have the schema's structure, and genq's strict check
    keeps only those that are JSON and match (xgrammar lets raw control characters into
    strings, which JSON forbids: docs/SGLANG.md)."""
    schema = json.loads(json.dumps(SCHEMA))
    schema["properties"]["name"]["maxLength"] = 12  # the random model's strings end sooner
    (tmp_path / "s.json").write_text(json.dumps(schema))
    n = 8
    server = start_server("real", "tuned")
    try:
        data = write_dataset(tmp_path / "d.jsonl", n)
        genq("produce", str(data), "--once", "--schema", str(tmp_path / "s.json"),
             "--max-tokens", "400", "--set", "enable_thinking=false", redis_url=redis_url,
             run=run_name)
        run_to_end(redis_url, run_name, server, tmp_path / "out", timeout=600)
        records = export(tmp_path, redis_url, run_name)
        status = orjson.loads(genq("status", "--json", redis_url=redis_url,
                                   run=run_name).stdout)
    finally:
        server.close()
    record_figures("schema_real", schema=status["schema"], failed=status["failed"],
                   finish=status["finish_reasons"])
    stopped = [rec for rec in records if rec.get("finish_reason") == "stop"]
    assert len(records) == n and stopped
    assert all(valid(rec["content"]) for rec in stopped)
    for rec in records:
        if rec.get("status") == "failed":  # the server's structure, but not strict JSON
            answer = json.loads(rec["answer"]["content"], strict=False)
            assert answer["grade"] in ("A", "B", "C")


def test_the_answer_kept_for_a_failed_prompt_is_bounded(redis_url, r, run_name):
    """A server that ignores the schema fails every prompt, each keeping its last answer in
    Redis: a long answer must not cost Redis its whole length per prompt."""
    import asyncio

    import redis.asyncio as aioredis

    from genq.common.errors import AnswerInvalid
    from genq.common.queue.keys import RunKeys
    from genq.consumer.structured import KEEP_CHARS, Structured

    r.setbit(RunKeys(run_name).failed, 7, 1)  # a copy is kept only of a prompt still failed

    async def fail_one() -> None:
        client = aioredis.Redis.from_url(redis_url)
        structured = Structured(client, RunKeys(run_name), lambda op: op())
        await structured.failed(AnswerInvalid(7, "answer is not JSON", {
            "params_version": 1, "finish_reason": "stop", "violation": "answer is not JSON",
            "content": "x" * 1_000_000, "reasoning_content": "y" * 1_000_000}))
        await client.aclose()

    asyncio.run(fail_one())
    raw = r.hget(RunKeys(run_name).invalid, "7")
    kept = orjson.loads(raw)
    assert len(raw) < 3 * KEEP_CHARS and kept["content"] == "x" * KEEP_CHARS
    assert kept["reasoning_content"] == "y" * KEEP_CHARS and kept["cut_at"] == KEEP_CHARS
    assert r.hget(RunKeys(run_name).counters, "schema_failed|1") == b"1"
