"""A Parquet data set written as one huge row group must not stall the consumer: rows are read
off the event loop and converted in small batches, so lease renewal keeps running."""

from __future__ import annotations

import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from faultkit import Background, Consumer, sim_kwargs
from pipeline import wait_for

from genq.common.queue.keys import RunKeys

ROWS = 200_000


def write_one_row_group(path, rows: int) -> None:
    """rows chat prompts with some bulk, as ONE row group (built in Arrow, so it is quick)."""
    contents = pa.array([f"Write program number {i}. " + "x" * 200 for i in range(rows)])
    roles = pa.array(["user"] * rows)
    messages = pa.ListArray.from_arrays(
        pa.array(range(rows + 1), pa.int32()),
        pa.StructArray.from_arrays([roles, contents], names=["role", "content"]))
    ids = pa.array([f"p{i}" for i in range(rows)])
    pq.write_table(pa.table({"id": ids, "messages": messages}), path, row_group_size=rows)


@pytest.mark.slow  # a 200k-row data set indexed while leases run: a scale test
def test_one_row_group_of_200k_rows_keeps_leases_renewed(
        tmp_path, redis_url, r, run_name, sim_factory):
    data = tmp_path / "d.parquet"
    write_one_row_group(data, ROWS)
    assert pq.ParquetFile(data).metadata.num_row_groups == 1
    # The windowed producer registers the run, keeps a few jobs queued and reaps expired
    # leases ten times a second: a consumer whose loop stalls past its lease loses them.
    producer = Background(redis_url, run_name, "produce", str(data), "--window", "16",
                          "--interval", "0.1", "--max-tokens", "300")
    sim = sim_factory(**sim_kwargs(0.2))
    k = RunKeys(run_name)
    # A consumer exits on a run not registered yet, and the producer reads 200k rows first.
    wait_for(lambda: r.exists(k.meta), timeout=60, what="the run registered")
    consumer = Consumer(redis_url, run_name, sim.url, tmp_path / "out", vt=1.5)
    try:
        wait_for(lambda: r.bitcount(k.done) >= 40, timeout=90, what="40 prompts done")
        consumer.signal(signal.SIGTERM)
        assert consumer.wait(30) == 0, consumer.log()[-3000:]
        seen = consumer.event_names()
    finally:
        consumer.cleanup()
        producer.cleanup()
    assert seen["lease_lost"] == 0 and seen["ack_refused"] == 0, seen
    assert seen["consumer_started"] == 1
