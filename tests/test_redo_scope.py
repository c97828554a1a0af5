"""A redo's scope holds for results still in flight when it was issued, and a redo never loses
a result: the one it set aside stands again (marked kept) if the new attempt fails for good."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import genq
from pipeline import ConsumerProcess, wait_for, write_dataset
from pipeline import exported as export
from pipeline import status_json as status

from genq.common.queue.keys import RunKeys


@pytest.mark.timeout(120)
def test_redo_truncated_covers_results_still_in_flight(tmp_path, redis_url, r, run_name,
                                                       sim_factory):
    """The issue's reproduction: 12 prompts, 4 slots, every v1 result truncated; the 4 in
    flight at `--redo truncated --inflight finish` end truncated after it."""
    data = write_dataset(tmp_path / "d.jsonl", 12)
    sim = sim_factory(time_scale=2, max_running_requests=4, length_dist="fixed:400")
    genq("produce", str(data), "--once", "--max-tokens", "300", redis_url=redis_url,
         run=run_name)
    k = RunKeys(run_name)
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "o", "--burst")
    try:
        wait_for(lambda: r.zcard(k.leases) >= 4, what="4 in flight (and one claimed ahead)")
        genq("requeue", "--set", "max_tokens=500", "--redo", "truncated", "--inflight",
             "finish", redis_url=redis_url, run=run_name)
        assert c.wait(90) == 0, c.log()[-3000:]
        set_aside = c.log().count("result_set_aside")
    finally:
        c.cleanup()
    records = export(tmp_path, redis_url, run_name)
    assert len(records) == 12
    assert Counter(rec["finish_reason"] for rec in records) == {"stop": 12}
    assert {rec["params_version"] for rec in records} == {2}
    st = status(redis_url, run_name)
    assert st["finish_reasons"] == {"stop": 12} and st["truncated"] == 0
    assert st["output_tokens"]["max"] == 400
    assert set_aside >= 1  # in-flight v1 results really ended after the redo


@pytest.mark.timeout(120)
def test_a_failed_redo_keeps_the_previous_result(tmp_path, redis_url, r, run_name, sim_factory):
    n, poison = 10, (3, 7)
    data = write_dataset(tmp_path / "d.jsonl", n, poison=poison)
    lenient = sim_factory(time_scale=1000, bad_marker="__nothing_matches__")
    strict = sim_factory(time_scale=1000)  # answers the poison prompts with HTTP 400
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    c = ConsumerProcess(redis_url, run_name, lenient.url, tmp_path / "o", "--burst")
    assert c.wait(60) == 0
    c.cleanup()
    before = {rec["index"]: rec for rec in export(tmp_path, redis_url, run_name)}
    genq("requeue", "--set", "temperature=0.1", "--redo", "all", redis_url=redis_url,
         run=run_name)
    # Set aside, not forgotten: the previous results are still in Redis's accepted fields.
    assert status(redis_url, run_name)["done"] == 0
    c = ConsumerProcess(redis_url, run_name, strict.url, tmp_path / "o", "--burst")
    assert c.wait(60) == 0, c.log()[-3000:]
    c.cleanup()
    st = status(redis_url, run_name)
    assert (st["done"], st["failed"], st["kept"]) == (n, 0, 2)
    records = export(tmp_path, redis_url, run_name)
    assert [rec["index"] for rec in records] == list(range(n))
    for rec in records:
        if rec["index"] in poison:  # the v1 result, exactly as it was, marked kept
            assert rec.pop("kept") is True and rec == before[rec["index"]]
        else:
            assert "kept" not in rec and rec["params_version"] == 2
    assert sum(st["finish_reasons"].values()) == n
    assert st["output_tokens_total"] == sum(rec["completion_tokens"] for rec in records)
    # A later redo sets the kept results aside again, and a success replaces them.
    genq("requeue", "--redo", "all", redis_url=redis_url, run=run_name)
    assert status(redis_url, run_name)["kept"] == 0
    c = ConsumerProcess(redis_url, run_name, lenient.url, tmp_path / "o", "--burst")
    assert c.wait(60) == 0
    c.cleanup()
    records = export(tmp_path, redis_url, run_name)
    assert len(records) == n and not any("kept" in rec for rec in records)
    assert {rec["params_version"] for rec in records} == {3}


@pytest.mark.timeout(180)
def test_a_continued_result_that_stands_again_counts_as_continued(tmp_path, redis_url, r,
                                                                   run_name, sim_factory):
    """`genq status` counts the continued answers that stand: a redo that sets one aside
    uncounts it, and its failing for good makes it stand, and count, again."""
    n, poison = 8, (2, 5)
    data = write_dataset(tmp_path / "d.jsonl", n, poison=poison)
    lenient = sim_factory(time_scale=1000, bad_marker="__nothing_matches__",
                          length_dist="fixed:400")
    strict = sim_factory(time_scale=1000, length_dist="fixed:400")

    def run_on(sim) -> None:
        c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "o", "--burst")
        assert c.wait(60) == 0, c.log()[-3000:]
        c.cleanup()

    genq("produce", str(data), "--once", "--max-tokens", "300", redis_url=redis_url,
         run=run_name)
    run_on(lenient)
    genq("requeue", "--set", "max_tokens=500", "--redo", "truncated", "--continue",
         redis_url=redis_url, run=run_name)
    run_on(lenient)
    assert status(redis_url, run_name)["continued"] == {
        "2": {"continued": n, "decode_tokens_saved": 300 * n}}
    genq("requeue", "--set", "temperature=0.1", "--redo", "all", redis_url=redis_url,
         run=run_name)
    st = status(redis_url, run_name)
    assert st["done"] == 0
    assert not any(v["continued"] for v in st["continued"].values())  # all set aside
    run_on(strict)
    st = status(redis_url, run_name)
    assert (st["done"], st["failed"], st["kept"]) == (n, 0, len(poison))
    kept = [rec for rec in export(tmp_path, redis_url, run_name) if rec.get("kept")]
    assert sorted(rec["index"] for rec in kept) == list(poison)
    assert all(rec["continued_from"]["tokens"] == 300 for rec in kept)
    assert {v: c for v, c in st["continued"].items() if c["continued"]} == {
        "2": {"continued": len(poison), "decode_tokens_saved": 300 * len(poison)}}
