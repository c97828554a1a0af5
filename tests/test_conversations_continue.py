"""`genq requeue --redo truncated --continue` in a `--turns all` run: each truncated
conversation's cut turn is continued from its partial by ids (the prompt's and the partial's
as `input_ids`), then the turns after it are made; the turns before it are never asked again.
The simulator is deterministic, so every conversation ends as a straight run at the larger
limit makes it."""

from __future__ import annotations

import re

import httpx
import orjson
import pytest
from conftest import genq
from pipeline import consume_to_the_end, continue_truncated, redone_chains
from test_conversations import (
    PROBE,
    by_conversation,
    check_chains,
    conversation,
    export,
    write_rows,
)
from test_s3 import URI, bucket_records, s3  # noqa: F401  (s3: the moto fixture)

from genq.common.queue.keys import RunKeys

SMALL, LARGE = 50, 2000


def served(sim) -> dict[str, int]:
    """The simulator's counters: requests, prompt (prefill) tokens and generated tokens."""
    text = httpx.get(sim.url + "/metrics", timeout=5).text
    return {name: int(float(re.search(rf"^sglang:{name}\S* (\S+)$", text, re.M).group(1)))
            for name in ("num_requests_total", "prompt_tokens_total", "generation_tokens_total")}


def made(rec: dict) -> tuple:
    """What a generation made; a tool call's id is the server's fresh one each time."""
    calls = [{**call, "id": None} for call in rec.get("tool_calls") or ()]
    return (rec["turn"], rec["prompt_token_ids"], rec["completion_token_ids"],
            rec.get("reasoning_content"), rec["content"], calls, rec["finish_reason"],
            rec.get("stopped"), rec.get("ended"))


def went_on(first: dict, chains: dict, truncated: dict, straight: dict | None = None
            ) -> list[dict]:
    """Each conversation against the first run's: as it was if it was not cut, else its turns
    before the cut kept, the cut turn continued from its partial by ids (and the whole as the
    `straight` run's, if given). Returns the generations asked after the requeue."""
    asked: list[dict] = []
    for key, chain in chains.items():
        if key not in truncated:
            assert chain == first[key], key
            continue
        t, cut = truncated[key]["turn"], truncated[key]
        assert chain[:t - 1] == first[key][:t - 1], key
        assert chain[t - 1]["continued_from"] == {
            "version": 1, "attempt": cut["attempt"], "tokens": cut["completion_tokens"]}, key
        assert chain[t - 1]["completion_token_ids"][:SMALL] == cut["completion_token_ids"]
        assert straight is None or [made(rec) for rec in chain] == [
            made(rec) for rec in straight[key]], key
        asked += chain[t - 1:]
    return asked


def cut_and_straight(tmp_path, redis_url: str, run_name: str, sim_factory, n: int,
                     *extra: str) -> tuple[list, dict, dict]:
    """(rows, sims, runs): n conversations made twice with --token-ids and `extra`, each run on
    its own simulator: cut at SMALL tokens (runs["cont"], the run under test) and straight at
    LARGE (runs["straight"]), what every continued conversation must end as."""
    rows = [conversation(i) for i in range(n)]
    data = write_rows(tmp_path / "conversations.jsonl", rows)
    sim_kwargs = dict(time_scale=200, tool_call_rate=0.6, length_dist="lognormal:40:0.5")
    sims = {"cont": sim_factory(**sim_kwargs), "straight": sim_factory(**sim_kwargs)}
    runs = {"cont": (run_name, SMALL), "straight": (run_name + "-straight", LARGE)}
    for name, (run, limit) in runs.items():
        genq("produce", str(data), "--once", "--turns", "all", *extra, "--max-tokens",
             str(limit), "--token-ids", redis_url=redis_url, run=run)
        consume_to_the_end(redis_url, run, sims[name].url, tmp_path / name)
    return rows, sims, runs


@pytest.mark.timeout(240)
def test_a_truncated_turn_is_continued_by_ids_and_the_conversation_goes_on(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 40
    rows, sims, runs = cut_and_straight(tmp_path, redis_url, run_name, sim_factory, n)
    first = check_chains(rows, export(tmp_path, redis_url, run_name, "first.jsonl"))
    straight_records = export(tmp_path, redis_url, runs["straight"][0], "straight.jsonl")
    straight = check_chains(rows, straight_records)
    truncated = {i: chain[-1] for i, chain in first.items()
                 if chain[-1]["finish_reason"] == "length"}
    # Cut at a later turn too, so that there are earlier turns not to ask again.
    assert len(truncated) >= 5 and any(rec["turn"] > 1 for rec in truncated.values()), truncated

    before = served(sims["cont"])
    dry = genq("requeue", "--set", f"max_tokens={LARGE}", "--redo", "truncated", "--continue",
               "--dry-run", redis_url=redis_url, run=run_name).stdout
    assert f"continue: {len(truncated)} truncated answers" in dry and "; 0 are generated" in dry
    assert r.exists(RunKeys(run_name).partials) == 0  # a dry run keeps nothing
    continue_truncated(redis_url, run_name, LARGE, len(truncated))
    consume_to_the_end(redis_url, run_name, sims["cont"].url, tmp_path / "cont")
    after = served(sims["cont"])
    redone = export(tmp_path, redis_url, run_name, "redone.jsonl")
    chains = check_chains(rows, redone)

    asked: list[dict] = []
    for index, chain, t in redone_chains(chains, first, truncated):
        cut, again = truncated[index], chain[t - 1]
        assert again["params_version"] == 2 and again["continued_from"] == {
            "version": 1, "attempt": cut["attempt"], "tokens": cut["completion_tokens"]}, again
        assert again["completion_token_ids"][:SMALL] == cut["completion_token_ids"], index
        assert all("continued_from" not in rec for rec in chain[t:]), index
        asked += chain[t - 1:]
        # ... and the whole conversation is the one a straight run at the larger limit makes.
        assert [made(rec) for rec in chain] == [made(rec) for rec in straight[index]], index
    assert any(len(chains[i]) > rec["turn"] for i, rec in truncated.items())
    assert r.exists(RunKeys(run_name).partials) == 0  # each used once

    # What the server was asked after the requeue: the continued turns and the turns after
    # them, nothing earlier (and the consumer's start probe). Each continued turn's prompt was
    # its partial's prompt and completion ids; only the rest was decoded. The probe's own
    # tokens are what the straight run's server counted beyond its records'.
    probe = {"prompt_tokens_total": served(sims["straight"])["prompt_tokens_total"]
             - sum(rec["prompt_tokens"] for rec in straight_records),
             "generation_tokens_total": served(sims["straight"])["generation_tokens_total"]
             - sum(rec["completion_tokens"] for rec in straight_records)}
    kept = sum(rec["completion_tokens"] for rec in truncated.values())
    assert after["num_requests_total"] - before["num_requests_total"] == PROBE + len(asked)
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == \
        probe["prompt_tokens_total"] + sum(rec["prompt_tokens"] for rec in asked) + kept
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == \
        probe["generation_tokens_total"] + sum(rec["completion_tokens"] for rec in asked) - kept

    # Export as conversations holds each whole, as the straight run's; status says what export
    # writes.
    shaped = export(tmp_path, redis_url, run_name, "conv.jsonl", "--format", "conversations")
    want = export(tmp_path, redis_url, runs["straight"][0], "want.jsonl", "--format",
                  "conversations")

    def strip(rows_out: list[dict]) -> list[dict]:
        # Call ids are the server's own, each run its own; a result carries its call's.
        return [orjson.loads(re.sub(rb'"(id|tool_call_id)":"call_[^"]*"', rb'"\1":null',
                                    orjson.dumps(row))) for row in rows_out]

    assert strip(shaped) == strip(want) and len(shaped) == n
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    conv = status["conversations"]
    assert (conv["done"], conv["total"], conv["generations"]) == (n, n, len(redone))
    assert len(by_conversation(redone)) == n
    # Every continued turn counts as continued, the last of its conversation or not.
    assert status["continued"] == {"2": {"continued": len(truncated),
                                         "decode_tokens_saved": kept}}, status["continued"]


@pytest.mark.timeout(240)
def test_without_ids_the_truncated_turn_is_continued_by_its_text(
        tmp_path, redis_url, r, run_name, sim_factory):
    """A run without --token-ids continues the cut turn as one-turn runs do: its text sent back
    as the final assistant message to continue; the turns before it are not asked again."""
    n = 40
    rows = [conversation(i) for i in range(n)]
    data = write_rows(tmp_path / "conversations.jsonl", rows)
    sim = sim_factory(time_scale=200, tool_call_rate=0.6, length_dist="lognormal:40:0.5",
                      reasoning_parser="qwen3")
    genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", str(SMALL),
         redis_url=redis_url, run=run_name)
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out")
    first = by_conversation(export(tmp_path, redis_url, run_name, "first.jsonl"))
    truncated = {i: chain[-1] for i, chain in first.items()
                 if chain[-1]["finish_reason"] == "length"}
    assert len(truncated) >= 5 and any(rec["turn"] > 1 for rec in truncated.values()), truncated

    before = served(sim)
    continue_truncated(redis_url, run_name, LARGE, len(truncated))
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out")
    redone = export(tmp_path, redis_url, run_name, "redone.jsonl")
    chains = by_conversation(redone)
    asked = 0
    for index, chain, t in redone_chains(chains, first, truncated):
        cut, again = truncated[index], chain[t - 1]
        assert [rec["turn"] for rec in chain] == list(range(1, len(chain) + 1)), index
        assert again["continued_from"] == {"version": 1, "attempt": cut["attempt"],
                                           "tokens": cut["completion_tokens"]}, again
        assert (again["reasoning_content"] or "").startswith(cut["reasoning_content"] or "")
        assert again["completion_tokens"] > SMALL or again["finish_reason"] != "length"
        asked += len(chain) - (t - 1)
    assert any(len(chains[i]) > rec["turn"] for i, rec in truncated.items())
    # (A run without ids asks no probe at a consumer's start.)
    assert served(sim)["num_requests_total"] - before["num_requests_total"] == asked
    assert r.exists(RunKeys(run_name).partials) == 0
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    assert (status["conversations"]["done"], status["conversations"]["generations"]) == (
        n, len(redone))
    assert status["continued"]["2"]["continued"] == len(truncated)

    # A redo of all sets every conversation aside: its continued turns, its last or not, no
    # longer count as continued once it is made again from its first turn.
    genq("requeue", "--set", f"max_tokens={LARGE + 1}", "--redo", "all",
         redis_url=redis_url, run=run_name)
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out")
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    assert status["conversations"]["done"] == n
    assert status["continued"] == {}, status["continued"]


def by_sample(rows: list[list[dict]], records: list[dict], samples: int
              ) -> dict[tuple[int, int], list[dict]]:
    """(index, sample) -> its conversation's generations, turn 1 first, each sample's chains
    checked as check_chains checks a run of one."""
    return {(index, s): chain for s in range(samples) for index, chain in
            check_chains(rows, [rec for rec in records if rec.get("sample", 0) == s]).items()}


@pytest.mark.timeout(240)
def test_each_sample_continues_its_own_partial(tmp_path, redis_url, r, run_name, sim_factory):
    """--samples 2: each (index, sample) conversation is its own task with its own seed, cut
    at its own turn; its partial is its task's, so every one ends as the straight run's same
    sample, and only the cut turns and those after them are asked."""
    n, samples = 24, 2
    rows, sims, runs = cut_and_straight(tmp_path, redis_url, run_name, sim_factory, n,
                                        "--samples", str(samples))
    first = by_sample(rows, export(tmp_path, redis_url, run_name, "first.jsonl"), samples)
    straight_records = export(tmp_path, redis_url, runs["straight"][0], "straight.jsonl")
    straight = by_sample(rows, straight_records, samples)
    truncated = {key: chain[-1] for key, chain in first.items()
                 if chain[-1]["finish_reason"] == "length"}
    # Both samples of some row cut, at different turns or with different partials.
    both = [i for i in range(n) if (i, 0) in truncated and (i, 1) in truncated]
    assert both and any(truncated[(i, 0)]["completion_token_ids"]
                        != truncated[(i, 1)]["completion_token_ids"] for i in both), both
    assert {s for _, s in truncated} == {0, 1}

    before = served(sims["cont"])
    continue_truncated(redis_url, run_name, LARGE, len(truncated))
    assert r.hlen(RunKeys(run_name).partials) == len(truncated)
    consume_to_the_end(redis_url, run_name, sims["cont"].url, tmp_path / "cont")
    after = served(sims["cont"])
    chains = by_sample(rows, export(tmp_path, redis_url, run_name, "redone.jsonl"), samples)
    asked = went_on(first, chains, truncated, straight)
    assert r.exists(RunKeys(run_name).partials) == 0
    kept = sum(rec["completion_tokens"] for rec in truncated.values())
    assert after["num_requests_total"] - before["num_requests_total"] == PROBE + len(asked)
    # The probe's tokens (the straight run's server counted them beyond its records') aside,
    # each continued turn's prompt was its partial's ids, and only the rest was decoded.
    probe = {key: served(sims["straight"])[f"{key}_tokens_total"]
             - sum(rec[f"{field}_tokens"] for rec in straight_records)
             for key, field in (("prompt", "prompt"), ("generation", "completion"))}
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == \
        probe["prompt"] + sum(rec["prompt_tokens"] for rec in asked) + kept
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == \
        probe["generation"] + sum(rec["completion_tokens"] for rec in asked) - kept
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    assert status["conversations"]["done"] == n * samples
    assert status["continued"] == {"2": {"continued": len(truncated),
                                         "decode_tokens_saved": kept}}, status["continued"]


@pytest.mark.timeout(240)
def test_the_cut_turns_are_read_from_s3_alone(tmp_path, redis_url, r, run_name, sim_factory,
                                              s3):  # noqa: F811
    """The consumers' disks are gone: `requeue --continue --from-s3` finds every cut turn in
    the bucket, and each conversation goes on from it; no earlier turn is asked again."""
    import shutil

    n = 30
    rows = [conversation(i) for i in range(n)]
    data = write_rows(tmp_path / "conversations.jsonl", rows)
    sim = sim_factory(time_scale=200, tool_call_rate=0.6, length_dist="lognormal:40:0.5")
    genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", str(SMALL),
         "--token-ids", redis_url=redis_url, run=run_name)
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out", "--s3-uri", URI,
                       "--shard-records", "20")
    first = check_chains(rows, export(tmp_path, redis_url, run_name, "first.jsonl"))
    truncated = {i: chain[-1] for i, chain in first.items()
                 if chain[-1]["finish_reason"] == "length"}
    assert len(truncated) >= 5 and any(rec["turn"] > 1 for rec in truncated.values())
    assert len(bucket_records(s3[0], run_name)) == sum(map(len, first.values()))
    shutil.rmtree(tmp_path / "out")

    before = served(sim)
    continue_truncated(redis_url, run_name, LARGE, len(truncated), "--from-s3", URI)
    consume_to_the_end(redis_url, run_name, sim.url, tmp_path / "out2", "--s3-uri", URI)
    chains = check_chains(rows, export(tmp_path, redis_url, run_name, "redone.jsonl",
                                       "--from-s3", URI))
    asked = len(went_on(first, chains, truncated))
    assert served(sim)["num_requests_total"] - before["num_requests_total"] == PROBE + asked
    assert r.exists(RunKeys(run_name).partials) == 0


@pytest.mark.slow  # a loss and recover
@pytest.mark.timeout(240)
def test_recover_keeps_the_partials_and_the_cut_turns_are_still_continued(
        tmp_path, run_name, sim_factory):
    """Redis loses everything after `requeue --continue`, before any continuation ran: `genq
    recover` keeps each cut turn's partial (of its own sample), as it does a one-turn run's,
    so every conversation still goes on from it and no earlier turn is asked again."""
    from faultkit import private_redis

    n, samples = 20, 2
    rows = [conversation(i) for i in range(n)]
    data = write_rows(tmp_path / "conversations.jsonl", rows)
    sim = sim_factory(time_scale=200, tool_call_rate=0.6, length_dist="lognormal:40:0.5")
    with private_redis() as redis_srv:
        url, r, k = redis_srv.url, redis_srv.client(), RunKeys(run_name)
        genq("produce", str(data), "--once", "--turns", "all", "--samples", str(samples),
             "--max-tokens", str(SMALL), "--token-ids", redis_url=url, run=run_name)
        consume_to_the_end(url, run_name, sim.url, tmp_path / "out")
        first = by_sample(rows, export(tmp_path, url, run_name, "first.jsonl"), samples)
        truncated = {key: chain[-1] for key, chain in first.items()
                     if chain[-1]["finish_reason"] == "length"}
        assert len(truncated) >= 5 and any(rec["turn"] > 1 for rec in truncated.values())
        genq("requeue", "--set", f"max_tokens={LARGE}", "--redo", "truncated", "--continue",
             redis_url=url, run=run_name)
        kept = dict(r.hgetall(k.partials))
        assert len(kept) == len(truncated)

        r.flushall()
        out = genq("recover", "--shards", str(tmp_path / "out"), redis_url=url, run=run_name)
        assert "recovered run" in out.stdout, out.stdout
        assert dict(r.hgetall(k.partials)) == kept  # the very partials, each its task's

        before = served(sim)
        consume_to_the_end(url, run_name, sim.url, tmp_path / "out")
        chains = by_sample(rows, export(tmp_path, url, run_name, "redone.jsonl"), samples)
        asked = len(went_on(first, chains, truncated))
        assert served(sim)["num_requests_total"] - before["num_requests_total"] == PROBE + asked
        assert not r.exists(k.partials)
        status = orjson.loads(genq("status", "--json", redis_url=url, run=run_name).stdout)
        assert status["continued"]["2"]["continued"] == len(truncated), status["continued"]
        r.close()
