"""`genq produce --once` on a live run queues a window, not the rest of a large data set; on a
run nobody works yet it still queues every unfinished index (the contract)."""

from __future__ import annotations

import pytest
from conftest import genq
from faultkit import Background
from pipeline import ConsumerProcess, wait_for, write_dataset

from genq.common.queue.keys import RunKeys


@pytest.mark.timeout(120)
def test_produce_once_on_a_live_run_queues_only_a_window(tmp_path, redis_url, r, run_name,
                                                         sim_factory):
    n = 3000
    data = write_dataset(tmp_path / "d.jsonl", n)
    sim = sim_factory(time_scale=1, max_running_requests=4, length_dist="fixed:200")
    k = RunKeys(run_name)
    producer = Background(redis_url, run_name, "produce", str(data), "--window", "16")
    try:
        wait_for(lambda: r.llen(k.rq_queue) >= 16, what="the window queued")
    finally:
        assert producer.stop() == 0
        producer.cleanup()
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "o")
    try:
        wait_for(lambda: r.zcard(k.consumers) and r.zcard(k.leases) >= 4, what="consumer busy")
        out = genq("produce", str(data), "--once", redis_url=redis_url, run=run_name).stdout
        assert "the run is live" in out
        # The window is max(64, twice the consumers' capacity); nothing like 3000 jobs.
        assert r.llen(k.rq_queue) <= 64 and r.bitcount(k.pending) <= 64 + 4 + 1  # 1 ready
    finally:
        c.cleanup()


def test_produce_once_on_an_idle_run_queues_everything(tmp_path, redis_url, r, run_name):
    out = genq("produce", str(write_dataset(tmp_path / "d.jsonl", 300)), "--once",
               redis_url=redis_url, run=run_name).stdout
    assert "enqueued 300 of 300" in out and "live" not in out
    assert r.llen(RunKeys(run_name).rq_queue) == 300


def test_produce_refuses_a_data_set_whose_rows_can_never_be_prompts(tmp_path, redis_url, r,
                                                                    run_name):
    """No `messages`/`prompt` column or key, or no rows: one line, exit non-zero, no run."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "text.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    (tmp_path / "text.jsonl").write_text('{"text": "a"}\n{"text": "prompt"}\n\n')
    (tmp_path / "empty.jsonl").write_text("")
    for name in ("text.parquet", "empty.parquet", "text.jsonl", "empty.jsonl"):
        proc = genq("produce", str(tmp_path / name), "--once", redis_url=redis_url,
                    run=run_name, check=False)
        assert proc.returncode != 0 and proc.stderr.count("\n") == 1, (name, proc.stderr)
        assert name in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not r.exists(RunKeys(run_name).meta), name
    # One row that can be a prompt is enough: the others fail one by one, as bad rows do.
    (tmp_path / "one.jsonl").write_text('{"text": "a"}\n{"prompt": "hi"}\n')
    out = genq("produce", str(tmp_path / "one.jsonl"), "--once", redis_url=redis_url,
               run=run_name).stdout
    assert "enqueued 2 of 2" in out
