"""`genq produce --samples K`: K answers a prompt, each its own task with its own seed; status,
redo, export and recover work per sample; K=1 runs keep records as they were."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import genq
from pipeline import ConsumerProcess, write_dataset
from pipeline import exported as export
from pipeline import status_json as status

from genq.common.data import manifest as manifests
from genq.common.queue import bitmap
from genq.common.queue.keys import RunKeys
from genq.common.task import request_seed, task_of

ROWS, K = 50, 4  # 600 generations over three passes: every check holds at this size


def consume(redis_url: str, run: str, sim, out) -> None:
    c = ConsumerProcess(redis_url, run, sim.url, out, "--burst")
    try:
        assert c.wait(120) == 0, c.log()[-3000:]
    finally:
        c.cleanup()


def answer(rec: dict) -> tuple:
    return rec["finish_reason"], rec["completion_tokens"], rec["content"]


@pytest.mark.slow  # three runs to the end and a Redis loss and recover
@pytest.mark.timeout(240)
def test_samples_are_distinct_reproducible_and_per_sample(tmp_path, redis_url, r, run_name,
                                                           sim_factory):
    data = write_dataset(tmp_path / "d.jsonl", ROWS)
    sim = sim_factory(time_scale=2000, length_dist="lognormal:300:0.5")
    genq("produce", str(data), "--once", "--samples", str(K), "--max-tokens", "400",
         redis_url=redis_url, run=run_name)
    consume(redis_url, run_name, sim, tmp_path / "o")
    records = export(tmp_path, redis_url, run_name)
    # One record per (index, sample), in task order, each with its sample's seed.
    assert [(rec["index"], rec["sample"]) for rec in records] == \
        [(i, s) for i in range(ROWS) for s in range(K)]
    assert all(rec["seed"] == request_seed(0, rec["index"], rec["sample"]) for rec in records)
    assert all(rec["id"] == f"p{rec['index']}" for rec in records)
    st = status(redis_url, run_name)
    truncated = [task_of(rec, K) for rec in records if rec["finish_reason"] == "length"]
    assert (st["total"], st["done"], st["samples"]) == (ROWS * K, ROWS * K, K)
    assert st["prompts_done"] == ROWS and st["truncated"] == len(truncated) > 0

    # --redo truncated: only the truncated samples run again, each with its own seed.
    genq("requeue", "--set", "max_tokens=4000", "--redo", "truncated",
         redis_url=redis_url, run=run_name)
    st = status(redis_url, run_name)
    assert st["done"] == ROWS * K - len(truncated)
    assert st["prompts_done"] == ROWS - len({t // K for t in truncated})
    consume(redis_url, run_name, sim, tmp_path / "o")
    after = export(tmp_path, redis_url, run_name)
    changed = [task_of(rec, K) for rec in after if rec["params_version"] == 2]
    assert changed == truncated
    assert all(rec["finish_reason"] == "stop" for rec in after)
    assert [rec["seed"] for rec in after] == [rec["seed"] for rec in records]
    # Different seeds, different lengths drawn: K distinct answers for nearly every prompt.
    distinct = Counter(len({answer(rec) for rec in after[i * K:(i + 1) * K]})
                       for i in range(ROWS))
    assert distinct[K] >= ROWS * 0.9, distinct

    # --redo all under the same parameters: every sample its same seed and answer.
    genq("requeue", "--redo", "all", redis_url=redis_url, run=run_name)
    consume(redis_url, run_name, sim, tmp_path / "o")
    again = export(tmp_path, redis_url, run_name)
    assert {rec["params_version"] for rec in again} == {3}
    assert [(rec["seed"], answer(rec)) for rec in again] == \
        [(rec["seed"], answer(rec)) for rec in after]

    # Recover rebuilds the samples exactly.
    assert manifests.find(tmp_path / "o", run_name)["samples"] == K
    r.flushall()
    genq("recover", "--shards", str(tmp_path / "o"), redis_url=redis_url, run=run_name)
    st = status(redis_url, run_name)
    assert (st["total"], st["done"], st["prompts_done"]) == (ROWS * K, ROWS * K, ROWS)
    assert export(tmp_path, redis_url, run_name, name="r.jsonl") == again

    # Parquet carries the sample as a typed column.
    import pyarrow.parquet as pq
    genq("export", "--out", str(tmp_path / "e.parquet"), redis_url=redis_url, run=run_name)
    table = pq.read_table(tmp_path / "e.parquet")
    assert table.column("sample").to_pylist() == [s for _ in range(ROWS) for s in range(K)]
    assert table.column("seed").to_pylist() == [rec["seed"] for rec in again]


def test_a_run_of_one_sample_keeps_its_records_and_meta(tmp_path, redis_url, r, run_name,
                                                         sim_factory):
    data = write_dataset(tmp_path / "d.jsonl", 5)
    sim = sim_factory(time_scale=2000)
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    assert b"samples" not in r.hgetall(RunKeys(run_name).meta)
    consume(redis_url, run_name, sim, tmp_path / "o")
    records = export(tmp_path, redis_url, run_name)
    assert [rec["index"] for rec in records] == list(range(5))
    assert not any("sample" in rec or "seed" in rec for rec in records)
    st = status(redis_url, run_name)
    assert (st["total"], st["done"], st["prompts_done"], st["samples"]) == (5, 5, 5, 1)


def test_a_run_cannot_change_its_samples(tmp_path, redis_url, run_name):
    data = write_dataset(tmp_path / "d.jsonl", 5)
    genq("produce", str(data), "--once", "--samples", "2", redis_url=redis_url, run=run_name)
    proc = genq("produce", str(data), "--once", redis_url=redis_url, run=run_name, check=False)
    assert proc.returncode != 0 and "2 samples a prompt" in proc.stderr


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_full_groups_counts_runs_of_set_bits(size):
    groups = 37
    on = {t for t in range(groups * size) if (t * 7919) % 5}  # a fixed, uneven pattern
    on |= set(range(size * 3, size * 5))  # and two whole groups for sure
    raw = bitmap.encode(on, groups * size)
    want = sum(all(g * size + j in on for j in range(size)) for g in range(groups))
    assert bitmap.full_groups(raw, groups, size) == want >= 2


def test_the_runs_seed_changes_every_samples_seed_and_one_sample_sends_none():
    from genq.common.task import Task

    def sample_of(task: int, samples: int, params: dict) -> dict | None:
        """The sample a task is and the seed its request carries (none: the params' own)."""
        seed = Task(task, samples, params).seed()
        return None if seed is None else {"sample": task % samples, "seed": seed}

    default = [sample_of(t, K, {}) for t in range(8)]
    assert default == [sample_of(t, K, {"seed": 0}) for t in range(8)]
    assert [s["sample"] for s in default] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert len({s["seed"] for s in default}) == 8
    assert all(0 <= s["seed"] < 2**31 for s in default)
    other = [sample_of(t, K, {"seed": 5}) for t in range(8)]
    assert all(a["seed"] != b["seed"] for a, b in zip(default, other, strict=True))
    assert sample_of(3, 1, {"seed": 5}) is None  # K = 1: the parameters go as they are


@pytest.mark.timeout(240)
def test_continue_continues_each_truncated_sample_from_its_own_partial(tmp_path, redis_url, r,
                                                                        run_name, sim_factory):
    rows, k = 60, 2
    data = write_dataset(tmp_path / "d.jsonl", rows)
    sim = sim_factory(time_scale=1000, reasoning_parser="qwen3", length_dist="lognormal:300:0.8")
    genq("produce", str(data), "--once", "--samples", str(k), "--max-tokens", "400",
         redis_url=redis_url, run=run_name)
    consume(redis_url, run_name, sim, tmp_path / "o")
    first = {task_of(rec, k): rec for rec in export(tmp_path, redis_url, run_name)}
    truncated = {t for t, rec in first.items() if rec["finish_reason"] == "length"}
    assert 5 < len(truncated) < rows * k
    out = genq("requeue", "--set", "max_tokens=1200", "--redo", "truncated", "--continue",
               redis_url=redis_url, run=run_name).stdout
    assert f"partials kept for --continue: {len(truncated)}" in out
    consume(redis_url, run_name, sim, tmp_path / "o")
    cont = {task_of(rec, k): rec for rec in export(tmp_path, redis_url, run_name, name="c.jsonl")}
    for t in truncated:
        old, new = first[t], cont[t]
        assert new["continued_from"] == {"version": 1, "attempt": old["attempt"],
                                         "tokens": old["completion_tokens"]}
        assert new["reasoning_content"].startswith(old["reasoning_content"])
        assert (new["sample"], new["seed"]) == (old["sample"], old["seed"])
    st = status(redis_url, run_name)
    assert st["continued"]["2"]["continued"] == len(truncated)


@pytest.mark.timeout(120)
def test_a_bad_prompt_is_named_by_its_row_and_sample(tmp_path, redis_url, run_name, sim_factory):
    """Row 17 of 30 is not JSON; with 2 samples its tasks are 34 and 35. Status, its table and
    the consumer's log name row 17 (as the export does), never task 34 or 35."""
    data = write_dataset(tmp_path / "d.jsonl", 30, bad_json=(17,))
    sim = sim_factory(time_scale=2000)
    genq("produce", str(data), "--once", "--samples", "2", redis_url=redis_url, run=run_name)
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "o", "--burst")
    try:
        assert c.wait(120) == 0, c.log()[-3000:]
        failed = [e for e in c.events() if e.get("event") == "task_failed"]
    finally:
        c.cleanup()
    assert sorted((e["index"], e["sample"]) for e in failed) == [(17, 0), (17, 1)]
    [reason] = status(redis_url, run_name)["failure_reasons"]
    assert (reason["count"], reason["example_index"], reason["example_sample"]) == (2, 17, 0)
    table = " ".join(genq("status", redis_url=redis_url, run=run_name).stdout.split())
    assert "(e.g. index 17, sample 0)" in table, table  # rich folds lines at 80 columns
