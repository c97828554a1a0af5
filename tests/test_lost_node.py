"""A node lost before its shards reached S3: `genq requeue --redo missing --from-s3` puts back
exactly the done tasks S3 holds no accepted result for, and a late ship of one of them never
gives the export two lines."""

from __future__ import annotations

import shutil
from collections import Counter

import orjson
import pytest
from conftest import genq
from pipeline import ConsumerProcess, read_jsonl, wait_for
from test_s3 import BUCKET, URI, bucket_records, s3, start_run  # noqa: F401  (s3: the moto fixture)

from genq.common.queue.keys import RunKeys
from genq.common.store import s3 as store


def run_consumer(redis_url, run, sim, out, name):
    c = ConsumerProcess(redis_url, run, sim.url, out, "--s3-uri", URI, "--name", name,
                        "--burst", "--shard-records", "10")
    try:
        assert c.wait(90) == 0, c.log()[-3000:]
    finally:
        c.cleanup()


@pytest.mark.slow  # a lost node
@pytest.mark.timeout(180)
def test_redo_missing_puts_back_what_s3_lacks_and_export_holds_each_once(
        tmp_path, redis_url, r, run_name, sim_factory, s3):  # noqa: F811
    client, _ = s3
    n = 60
    start_run(tmp_path, redis_url, run_name, n)
    sim = sim_factory(time_scale=400, max_running_requests=8)
    run_consumer(redis_url, run_name, sim, tmp_path / "a", "node-a")
    # The node is lost with two shards S3 never got: their objects go, and the disk with them.
    keys = store.shard_keys(client, store.parse_uri(URI), run_name)
    lost = {key: client.get_object(Bucket=BUCKET, Key=key)["Body"].read() for key in keys[1:3]}
    ids = {key.rsplit("/shard-", 1)[1].split(".")[0] for key in lost}
    lost_indices = {orjson.loads(line)["index"]
                    for _, sid, stream in store.iter_shards(client, store.parse_uri(URI), run_name)
                    if sid in ids for line in stream}
    for key in lost:
        client.delete_object(Bucket=BUCKET, Key=key)
    shutil.rmtree(tmp_path / "a")
    assert len(lost_indices) == 20
    out = tmp_path / "export.jsonl"
    warned = genq("export", "--from-s3", URI, "--out", str(out), redis_url=redis_url,
                  run=run_name, check=False)
    assert warned.returncode == 1

    put_back = genq("requeue", "--redo", "missing", "--from-s3", URI, redis_url=redis_url,
                    run=run_name)
    assert "queued again: 20 finished results (missing)" in put_back.stdout, put_back.stdout
    st = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    assert st["done"] == n - 20
    # Another node runs them; then the lost node's shards arrive after all (it came back).
    run_consumer(redis_url, run_name, sim, tmp_path / "b", "node-b")
    for key, body in lost.items():
        client.put_object(Bucket=BUCKET, Key=key, Body=body)
    genq("export", "--from-s3", URI, "--out", str(out), redis_url=redis_url, run=run_name)
    records = read_jsonl(out)
    assert Counter(rec["index"] for rec in records) == Counter(range(n))
    assert {rec["index"] for rec in records if rec["params_version"] == 2} == lost_indices


@pytest.mark.slow  # a node killed mid-run
@pytest.mark.timeout(180)
def test_a_node_killed_mid_run_loses_nothing_after_redo_missing(
        tmp_path, redis_url, r, run_name, sim_factory, s3):  # noqa: F811
    """The issue's case: two consumers, each its own --out shipping to S3; one killed -9
    mid-run and its disk gone; redo missing and one more consumer make the export whole."""
    n = 160
    start_run(tmp_path, redis_url, run_name, n)
    sim = sim_factory(time_scale=40, max_running_requests=4)
    flags = ("--s3-uri", URI, "--visibility-timeout", "3")
    # The lost node ships nothing before it dies (its shard never fills): all it did is lost.
    lost = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "a", *flags,
                           "--name", "node-a", "--shard-records", "1000")
    kept = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "b", *flags,
                           "--name", "node-b", "--burst", "--shard-records", "10")
    k = RunKeys(run_name)
    try:
        wait_for(lambda: bitcount(r, k.done) >= n // 4, timeout=60, what="a quarter done")
        lost.kill()
        shutil.rmtree(tmp_path / "a")
        assert kept.wait(120) == 0, kept.log()[-3000:]
    finally:
        lost.cleanup()
        kept.cleanup()
    st = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    assert st["done"] == n
    out = tmp_path / "export.jsonl"
    assert genq("export", "--from-s3", URI, "--out", str(out), redis_url=redis_url,
                run=run_name, check=False).returncode == 1
    put_back = genq("requeue", "--redo", "missing", "--from-s3", URI, redis_url=redis_url,
                    run=run_name)
    held = len(bucket_records(s3[0], run_name))
    assert f"queued again: {n - held} finished results (missing)" in put_back.stdout, \
        put_back.stdout
    assert 0 < n - held < n
    run_consumer(redis_url, run_name, sim, tmp_path / "c", "node-c")
    genq("export", "--from-s3", URI, "--out", str(out), redis_url=redis_url, run=run_name)
    assert Counter(rec["index"] for rec in read_jsonl(out)) == Counter(range(n))


def bitcount(r, key: str) -> int:
    return int(r.bitcount(key))


@pytest.mark.timeout(120)
def test_status_counts_done_results_not_yet_in_s3_and_keeps_a_dead_nodes_figure(
        tmp_path, redis_url, r, run_name, sim_factory, s3):  # noqa: F811
    """`unshipped`: done results on a node's disk only, per consumer and for the run, in
    status, its table and /metrics; a node killed with them keeps showing them."""
    import subprocess

    from genq.monitor import metrics

    n = 30
    start_run(tmp_path, redis_url, run_name, n)
    sim = sim_factory(time_scale=400, max_running_requests=8)
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "a", "--s3-uri", URI,
                        "--name", "node-a", "--shard-records", "1000")

    def status() -> dict:
        return orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)

    try:
        wait_for(lambda: (status()["shipping"] or {}).get("unshipped") == n, timeout=60,
                 what=f"{n} unshipped")
        c.kill()
    finally:
        c.cleanup()
    st = status()  # the dead node's last figure is still there: those results may be lost
    assert st["done"] == n and st["shipping"]["unshipped_by_consumer"] == {"node-a": n}
    assert f"unshipped {n}" in genq("status", redis_url=redis_url, run=run_name).stdout
    body = metrics.render(st)
    assert f'genq_results_unshipped{{run="{run_name}"}} {n}.0' in body
    check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stderr
