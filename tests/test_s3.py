"""Shipping shards to S3 and reading them back, against moto's S3 server on a real socket,
reached through a fault proxy that a test switches off to make S3 unreachable."""

from __future__ import annotations

import signal
from collections import Counter

import boto3
import orjson
import pytest
from conftest import free_port, genq
from faultproxy import FaultProxy
from moto.server import ThreadedMotoServer
from pipeline import ConsumerProcess, read_jsonl, wait_for, write_dataset

from genq.common.queue.keys import RunKeys
from genq.common.store import s3 as store

BUCKET = "genq-test"
PREFIX = "runs/exp1"
URI = f"s3://{BUCKET}/{PREFIX}"


@pytest.fixture
def s3(monkeypatch):
    """moto's S3 server, a bucket in it, and AWS_* set so every genq process goes to it
    through the proxy; yields (direct client, proxy)."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    proxy = FaultProxy(server._port).start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url("http", ""))
    direct = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{server._port}")
    direct.create_bucket(Bucket=BUCKET)
    yield direct, proxy
    proxy.stop()
    server.stop()


def bucket_records(client, run: str) -> list[dict]:
    """Every record of every shard object of the run, read straight from the bucket."""
    uri = store.parse_uri(URI)
    records = []
    for _, _, stream in store.iter_shards(client, uri, run):
        records += [orjson.loads(line) for line in stream]  # streams iterate lines
    return records


def ship_state(r, run: str) -> dict[str, str]:
    return {f.decode(): v.decode() for f, v in r.hgetall(RunKeys(run).ship).items()}


def start_run(tmp_path, redis_url, run, n):
    data = write_dataset(tmp_path / "data.jsonl", n)
    genq("produce", str(data), "--once", redis_url=redis_url, run=run)


def consumer(redis_url, run, sim, out, *flags):
    return ConsumerProcess(redis_url, run, sim.url, out, "--s3-uri", URI, *flags)


@pytest.mark.timeout(120)
def test_clean_run_ships_every_index_once_and_exports_agree(
        tmp_path, redis_url, r, run_name, sim_factory, s3):
    client, _ = s3
    n = 120
    start_run(tmp_path, redis_url, run_name, n)
    sim = sim_factory(time_scale=400, max_running_requests=8)
    manifest = tmp_path / "out" / f"{run_name}.manifest.json"  # the consumer writes it
    c = consumer(redis_url, run_name, sim, tmp_path / "out", "--burst", "--shard-records", "25")
    try:
        assert c.wait(90) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    keys = store.shard_keys(client, store.parse_uri(URI), run_name)
    assert len(keys) == 5 and all(k.startswith(f"{PREFIX}/{run_name}/") for k in keys)
    assert keys[0].endswith("-000001.jsonl.zst")
    # What recover reads: the manifest that went along, and the shards as line streams.
    found, streams = store.run_source(URI, run_name, lambda body, where: (where, body))
    assert found == [(f"s3://{BUCKET}/" + keys[0].rsplit("/", 1)[0] + "/manifest.json",
                      manifest.read_bytes())]
    assert sorted(orjson.loads(line)["index"] for f in streams for line in f) == list(range(n))
    indices = Counter(rec["index"] for rec in bucket_records(client, run_name))
    assert indices == Counter(range(n))  # every index, exactly once
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    ship = status["shipping"]
    assert ship["shards_shipped"] == 5 and ship["records_shipped"] == n
    assert ship["shards_pending"] == 0 and ship["last_error"] is None
    sizes = sum(client.head_object(Bucket=BUCKET, Key=k)["ContentLength"] for k in keys)
    assert ship["bytes_shipped"] == sizes
    table = genq("status", redis_url=redis_url, run=run_name).stdout
    assert f"S3 shipped 5 shards ({sizes:,} B)  pending 0 (0 B)" in table
    # Export from S3 is byte for byte the export from disk; Parquet holds the same records.
    local, remote = tmp_path / "local.jsonl", tmp_path / "remote.jsonl"
    genq("export", "--out", str(local), redis_url=redis_url, run=run_name)
    genq("export", "--from-s3", URI, "--out", str(remote), redis_url=redis_url, run=run_name)
    assert local.read_bytes() == remote.read_bytes() and len(read_jsonl(local)) == n
    parquet = tmp_path / "out.parquet"
    genq("export", "--from-s3", URI, "--format", "parquet", "--out", str(parquet),
         redis_url=redis_url, run=run_name)
    check_parquet(parquet, read_jsonl(local), tmp_path)


def check_parquet(path, records, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    assert table.schema.field("index").type == pa.int64()
    assert table.schema.field("completion_tokens").type == pa.int64()
    assert table.schema.field("latency_s").type == pa.float64()
    rows = table.to_pylist()
    assert [row["index"] for row in rows] == [rec["index"] for rec in records]
    for row, rec in zip(rows, records, strict=True):
        assert {k: row[k] for k in rec} == rec and row["extra"] is None
    loaded = datasets.load_dataset("parquet", data_files=str(path), split="train",
                                   cache_dir=str(tmp_path / "hf-cache"))
    assert loaded.num_rows == len(records) and loaded[0]["content"] == records[0]["content"]


@pytest.mark.slow  # an S3 outage window
@pytest.mark.timeout(150)
def test_outage_mid_run_loses_nothing_and_duplicates_nothing(
        tmp_path, redis_url, r, run_name, sim_factory, s3):
    client, proxy = s3
    n = 200
    start_run(tmp_path, redis_url, run_name, n)
    k = RunKeys(run_name)
    sim = sim_factory(time_scale=100, max_running_requests=8)
    c = consumer(redis_url, run_name, sim, tmp_path / "out", "--burst", "--shard-records", "10")
    try:
        wait_for(lambda: int(ship_state(r, run_name).get("shards", 0)) >= 2, 60,
                 what="the first shards shipped")
        proxy.set_mode("refuse")
        done_then = r.bitcount(k.done)
        # S3 is gone: generation goes on and the backlog is reported with the error.
        wait_for(lambda: sum(int(v) for f, v in ship_state(r, run_name).items()
                             if f.startswith("pending|")) >= 3, 60, what="a backlog")
        assert r.bitcount(k.done) > done_then
        assert any(f.startswith("error|") for f in ship_state(r, run_name))
        proxy.set_mode("pass")
        assert c.wait(90) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    records = bucket_records(client, run_name)
    assert Counter(rec["index"] for rec in records) == Counter(range(n))
    keys = store.shard_keys(client, store.parse_uri(URI), run_name)
    assert len(keys) == n // 10 == int(ship_state(r, run_name)["shards"])
    state = ship_state(r, run_name)
    assert not [f for f in state if f.startswith(("pending", "error"))]


@pytest.mark.slow  # a kill
@pytest.mark.timeout(150)
def test_killed_consumer_ships_its_backlog_after_restart(
        tmp_path, redis_url, r, run_name, sim_factory, s3):
    client, proxy = s3
    n = 60
    out = tmp_path / "out"
    start_run(tmp_path, redis_url, run_name, n)
    k = RunKeys(run_name)
    sim = sim_factory(time_scale=400, max_running_requests=8)
    proxy.set_mode("refuse")
    first = consumer(redis_url, run_name, sim, out, "--shard-records", "7", "--name", "gpu0")
    try:
        wait_for(lambda: r.bitcount(k.done) == n, 60, what="every prompt done")
        first.signal(signal.SIGKILL)
        first.wait(10)
    finally:
        first.cleanup()
    assert store.shard_keys(client, store.parse_uri(URI), run_name) == []
    # Still unreachable: --burst says what it could not ship, and exits non-zero.
    stuck = consumer(redis_url, run_name, sim, out, "--burst", "--ship-wait", "1")
    try:
        assert stuck.wait(60) == 1
        assert "shard(s) not shipped to " + URI in stuck.log()
    finally:
        stuck.cleanup()
    proxy.set_mode("pass")
    again = consumer(redis_url, run_name, sim, out, "--burst", "--delete-shipped")
    try:
        assert again.wait(60) == 0, again.log()[-3000:]
    finally:
        again.cleanup()
    assert Counter(rec["index"] for rec in bucket_records(client, run_name)) == Counter(range(n))
    assert not list(out.glob("*.jsonl"))  # verified in S3, so removed as asked
    remote = tmp_path / "remote.jsonl"
    genq("export", "--from-s3", URI, "--out", str(remote), redis_url=redis_url, run=run_name)
    assert [rec["index"] for rec in read_jsonl(remote)] == list(range(n))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("delete", [False, True], ids=["keep", "delete-shipped"])
def test_a_name_reused_on_an_empty_disk_ships_every_shard(
        tmp_path, redis_url, r, run_name, sim_factory, s3, delete):
    """A lost node's replacement, same --name on an empty disk, numbers its shards from 1
    again: each still reaches S3 (none taken as shipped before it), none deleted unshipped."""
    client, _ = s3
    n = 30
    start_run(tmp_path, redis_url, run_name, n)
    sim = sim_factory(time_scale=400, max_running_requests=8)
    flags = ("--burst", "--shard-records", "10", "--name", "gpu0",
             *(("--delete-shipped",) if delete else ()))
    for out in ("lost", "replacement"):
        c = consumer(redis_url, run_name, sim, tmp_path / out, *flags)
        try:
            assert c.wait(90) == 0, c.log()[-3000:]
        finally:
            c.cleanup()
        if out == "lost":  # every answer again, by the replacement alone
            genq("requeue", "--set", "temperature=0.5", "--redo", "all",
                 redis_url=redis_url, run=run_name)
    again = Counter(rec["index"] for rec in bucket_records(client, run_name)
                    if rec["params_version"] == 2)
    assert again == Counter(range(n))
    assert delete == (not list((tmp_path / "replacement").glob("*.jsonl")))
    remote = tmp_path / "remote.jsonl"
    genq("export", "--from-s3", URI, "--out", str(remote), redis_url=redis_url, run=run_name)
    assert [(rec["index"], rec["params_version"]) for rec in read_jsonl(remote)] \
        == [(i, 2) for i in range(n)]


def test_bad_uri_or_endpoint_is_one_clear_line(tmp_path, redis_url, run_name, monkeypatch):
    proc = genq("export", "--from-s3", "s3://A/x", "--out", str(tmp_path / "o"),
                redis_url=redis_url, run=run_name, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "not a valid bucket name" in proc.stderr
    proc = genq("consume", "--server", "http://127.0.0.1:1", "--s3-uri", "bucket/x",
                redis_url=redis_url, run=run_name, check=False)
    assert proc.returncode == 2 and "must look like s3://bucket/prefix" in proc.stderr
    start_run(tmp_path, redis_url, run_name, 3)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "not a url")
    proc = genq("export", "--from-s3", URI, "--out", str(tmp_path / "o"), redis_url=redis_url,
                run=run_name, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "cannot set up the S3 client: Invalid endpoint: not a url" in proc.stderr


async def ship_all(redis_url: str, uri, k: RunKeys, out) -> None:
    """One pass of a shipper over every finished shard in ``out``, in this process."""
    import redis.asyncio as aioredis

    from genq.common.store.ship import Shipper

    aio = aioredis.Redis.from_url(redis_url)
    shipper = Shipper(uri, k, "gpu0", out, aio)
    shipper.scan()
    for item in list(shipper.queue.values()):
        await shipper.ship(item)
    await aio.aclose()


def test_shipper_never_overwrites_other_content_and_never_doubles(tmp_path, redis_url, r,
                                                                   run_name, s3):
    """In-process: an object with the same content is taken as shipped; one with other content
    (written by no genq) is kept and the shard goes beside it; gzip reads back."""
    import asyncio
    import gzip
    import hashlib

    from genq.common.data.shards import ShardWriter

    client, _ = s3
    uri = store.parse_uri(URI)
    closed: list = []
    w = ShardWriter(tmp_path, run_name, "gpu0", rotate_every=2, on_close=closed.append)
    for i in range(4):
        w.write_many([{"index": i, "attempt": 1}])
    w.close()
    first, second = closed
    k = RunKeys(run_name)
    client.put_object(Bucket=BUCKET, Key=store.shard_key(uri, first),
                      Body=store.compress(b'{"index": 99, "note": "an earlier gpu0"}\n'))

    asyncio.run(ship_all(redis_url, uri, k, tmp_path))
    keys = store.shard_keys(client, uri, run_name)
    process = first.name.split(".")[2]  # {start}-{pid} of the writer
    taken = f"{PREFIX}/{run_name}/gpu0/shard-{process}-000001.jsonl.zst"
    sha = hashlib.sha256(first.read_bytes()).hexdigest()[:16]
    beside = taken.replace(".jsonl", f"-{sha}.jsonl")
    assert keys == sorted([taken, beside, store.shard_key(uri, second)])
    assert r.hlen(k.shipped) == 2 and ship_state(r, run_name)["records"] == "4"
    asyncio.run(ship_all(redis_url, uri, k, tmp_path))  # a restart: both recorded, none redone
    r.hdel(k.shipped, store.shard_key(uri, second))  # as if it crashed before recording
    put_before = r.hlen(k.shipped)
    asyncio.run(ship_all(redis_url, uri, k, tmp_path))
    assert store.shard_keys(client, uri, run_name) == keys  # nothing uploaded twice
    assert r.hlen(k.shipped) == put_before + 1
    client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{run_name}/gpu1/shard-000001.jsonl.gz",
                      Body=gzip.compress(b'{"index": 9}\n'))
    client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{run_name}/notes.txt", Body=b"not a shard")
    indices = [rec["index"] for rec in bucket_records(client, run_name) if "index" in rec]
    assert sorted(indices) == [0, 1, 2, 3, 9, 99]


def test_a_shard_an_older_genq_shipped_is_not_shipped_again(tmp_path, redis_url, r, run_name,
                                                             s3):
    """A record under the old per-name key (shard-000001) counts only for the file it names."""
    import asyncio

    from genq.common.data.shards import ShardWriter

    client, _ = s3
    uri, k = store.parse_uri(URI), RunKeys(run_name)
    w = ShardWriter(tmp_path, run_name, "gpu0")
    w.write_many([{"index": 0, "attempt": 1}])
    w.close()
    path, = tmp_path.glob("*.jsonl")
    legacy = store.legacy_shard_key(uri, path)
    assert legacy == f"{PREFIX}/{run_name}/gpu0/shard-000001.jsonl.zst"
    r.hset(k.shipped, legacy, orjson.dumps({"shard": path.name}))
    asyncio.run(ship_all(redis_url, uri, k, tmp_path))
    assert store.shard_keys(client, uri, run_name) == [] and r.hlen(k.shipped) == 1
    r.hset(k.shipped, legacy, orjson.dumps({"shard": "another node's shard 1"}))
    asyncio.run(ship_all(redis_url, uri, k, tmp_path))
    assert store.shard_keys(client, uri, run_name) == [store.shard_key(uri, path)]


def test_a_slow_trickle_still_ships_by_shard_age(tmp_path, redis_url, r, run_name, s3):
    import asyncio

    import redis.asyncio as aioredis

    from genq.common.data.shards import ShardWriter
    from genq.common.store.ship import Shipper

    client, _ = s3
    uri = store.parse_uri(URI)

    async def trickle() -> None:
        aio = aioredis.Redis.from_url(redis_url)
        shipper = Shipper(uri, RunKeys(run_name), "slow", tmp_path, aio, keep_local=False)
        w = ShardWriter(tmp_path, run_name, "slow", rotate_every=500, on_close=shipper.closed)
        task = asyncio.create_task(shipper.run(w, max_age_s=0.5))
        await asyncio.to_thread(w.write_many, [{"index": 7}])  # one record, far from 500
        for _ in range(200):
            if r.hget(RunKeys(run_name).ship, "shards"):
                break
            await asyncio.sleep(0.05)
        task.cancel()
        w.close()
        await aio.aclose()

    asyncio.run(trickle())
    assert [rec["index"] for rec in bucket_records(client, run_name)] == [7]
    assert not list(tmp_path.glob("*.jsonl"))  # shipped, verified, and removed as asked


@pytest.mark.slow  # a Redis loss and recover
@pytest.mark.timeout(150)
def test_recover_from_s3_alone_restores_the_run_exactly(
        tmp_path, redis_url, r, run_name, sim_factory, s3):
    """The machines and Redis are gone; the bucket (and the data set) are all that is left."""
    import shutil

    from conftest import RedisServer

    n = 60
    start_run(tmp_path, redis_url, run_name, n)
    sim = sim_factory(time_scale=400, max_running_requests=8)
    genq("requeue", "--set", "max_tokens=900", redis_url=redis_url, run=run_name)
    out = tmp_path / "out"
    c = consumer(redis_url, run_name, sim, out, "--burst", "--shard-records", "9")
    try:
        assert c.wait(90) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    before = tmp_path / "before.jsonl"
    genq("export", "--out", str(before), redis_url=redis_url, run=run_name)
    status_before = orjson.loads(genq("status", "--json", redis_url=redis_url,
                                      run=run_name).stdout)
    shutil.rmtree(out)
    (tmp_path / "fresh").mkdir()
    fresh = RedisServer(tmp_path / "fresh")
    fresh.start()
    try:
        got = genq("recover", "--from-s3", URI, redis_url=fresh.url, run=run_name)
        assert "recovered run" in got.stdout and "parameters v2" in got.stdout, got.stdout
        after = tmp_path / "after.jsonl"
        genq("export", "--from-s3", URI, "--out", str(after), redis_url=fresh.url, run=run_name)
        status_after = orjson.loads(genq("status", "--json", redis_url=fresh.url,
                                         run=run_name).stdout)
    finally:
        fresh.stop(kill=True)
    assert after.read_bytes() == before.read_bytes() and len(read_jsonl(after)) == n
    for key in ("total", "done", "failed", "params_version", "finish_reasons",
                "output_tokens", "params"):
        assert status_after[key] == status_before[key], key


@pytest.mark.timeout(60)
def test_a_dropped_download_resumes_from_the_byte_it_reached(tmp_path, s3, monkeypatch):
    """Every connection reset mid-download: the local copy is whole and exact, and the bytes
    received before the reset are not fetched again (the next GET starts where it broke)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from genq.common.data import remote

    client, proxy = s3
    data = os.urandom(6 << 20)
    client.put_object(Bucket=BUCKET, Key="data/big.jsonl", Body=data)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    proxy.delay = 0.005  # each 64 kB relayed: the download takes about half a second
    with ThreadPoolExecutor(1) as pool:
        copy = pool.submit(remote.local_copy, f"s3://{BUCKET}/data/big.jsonl")
        wait_for(lambda: proxy.relayed > 2 << 20, what="a third of the object received")
        proxy.delay = 1.0  # the stream held where it is, so a slow moment here cannot let it end
        proxy.set_mode("reset")
        received, proxy.delay = proxy.relayed, 0.005
        proxy.set_mode("pass")
        path, _ = copy.result(30)
    assert path.read_bytes() == data
    assert proxy.connections >= 2  # the reset really broke the stream
    # A resume fetches again at most the chunk that was being read when the stream broke (up to
    # remote._CHUNK, 1 MiB) and what sat in the sockets; starting from byte 0 fetches again all
    # the `received` bytes (over 2 MiB).
    assert proxy.relayed < len(data) + received, "the download started again from byte 0"
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.timeout(60)
def test_an_object_replaced_mid_download_is_refused_not_spliced(tmp_path, s3, monkeypatch):
    """The object is replaced while its copy is under way and the stream breaks: the resumed
    GET names the first version's ETag, so the copy stops with a clear error, leaving no file
    that is half one version and half the other."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from genq.common.data import remote
    from genq.common.errors import DatasetError

    client, proxy = s3
    client.put_object(Bucket=BUCKET, Key="data/big.jsonl", Body=os.urandom(6 << 20))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    proxy.delay = 0.005
    with ThreadPoolExecutor(1) as pool:
        copy = pool.submit(remote.local_copy, f"s3://{BUCKET}/data/big.jsonl")
        wait_for(lambda: proxy.relayed > 2 << 20, what="a third of the object received")
        proxy.delay = 1.0  # the stream held where it is while the object is replaced
        client.put_object(Bucket=BUCKET, Key="data/big.jsonl", Body=os.urandom(6 << 20))
        proxy.set_mode("reset")
        proxy.delay = 0.005
        proxy.set_mode("pass")
        with pytest.raises(DatasetError, match="replaced while it was downloaded"):
            copy.result(30)
    assert [p.name for p in remote.cache_dir().iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.timeout(150)
@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_data_set_in_s3_alone_is_produced_and_consumed(
        tmp_path, redis_url, run_name, sim_factory, s3, monkeypatch, suffix):
    """The data set exists only in the bucket: the producer and a consumer whose machine never
    saw the file (a fresh cache, the local copy deleted) read it by index from S3."""
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    from genq.common.data.dataset import open_dataset

    client, _ = s3
    n = 50
    local = write_dataset(tmp_path / "src.jsonl", n)
    if suffix == "parquet":
        pq.write_table(pj.read_json(local), tmp_path / "src.parquet", row_group_size=16)
        local = tmp_path / "src.parquet"
    fingerprints = []

    def fingerprint(where) -> None:
        ds = open_dataset(where)
        fingerprints.append(ds.fingerprint)
        ds.close()

    fingerprint(local)
    key = f"data/prompts.{suffix}"
    client.upload_file(str(local), BUCKET, key)
    local.unlink()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "producer-cache"))
    genq("produce", f"s3://{BUCKET}/{key}", "--once", redis_url=redis_url, run=run_name)
    status = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run_name).stdout)
    assert status["dataset"] == f"s3://{BUCKET}/{key}" and status["total"] == n
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "node2-cache"))
    sim = sim_factory(time_scale=400, max_running_requests=8)
    c = consumer(redis_url, run_name, sim, tmp_path / "node2", "--burst")
    try:
        assert c.wait(90) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    assert Counter(rec["index"] for rec in bucket_records(client, run_name)) == Counter(range(n))
    fingerprint(f"s3://{BUCKET}/{key}")
    assert fingerprints[0] == fingerprints[1]  # a copy in S3 is the same data set as the file


def truncated_run_shipped(tmp_path, redis_url, run, sim_factory, n, *, shard_records):
    """A run of n prompts at max_tokens 400 (about half cut), done by one consumer that shipped
    its shards to the bucket and left them in tmp_path/out."""
    data = write_dataset(tmp_path / "d.jsonl", n)
    genq("produce", str(data), "--once", "--max-tokens", "400", redis_url=redis_url, run=run)
    sim = sim_factory(time_scale=1000, length_dist="lognormal:300:0.8")
    c = consumer(redis_url, run, sim, tmp_path / "out", "--burst", "--shard-records",
                 str(shard_records))
    try:
        assert c.wait(90) == 0, c.log()[-3000:]
    finally:
        c.cleanup()


@pytest.mark.timeout(150)
def test_continue_reads_the_truncated_answers_from_s3_alone(
        tmp_path, redis_url, run_name, sim_factory, s3):
    """The consumers' disks are gone: `requeue --continue --from-s3` finds every truncated
    answer's partial in the bucket."""
    import shutil

    truncated_run_shipped(tmp_path, redis_url, run_name, sim_factory, 60, shard_records=20)
    truncated = [rec for rec in bucket_records(s3[0], run_name) if rec["finish_reason"] == "length"]
    assert truncated
    shutil.rmtree(tmp_path / "out")
    out = genq("requeue", "--set", "max_tokens=1200", "--redo", "truncated", "--continue",
               "--from-s3", URI, redis_url=redis_url, run=run_name).stdout
    assert f"partials kept for --continue: {len(truncated)}" in out


@pytest.mark.slow  # a Redis loss and recover
@pytest.mark.timeout(150)
def test_recover_from_s3_alone_keeps_what_pending_continuations_need(
        tmp_path, redis_url, r, run_name, sim_factory, s3):
    """Redis is lost after `requeue --continue`, and the consumers' disks with it: `recover
    --from-s3` finds every pending continuation's partial in the bucket, as --shards does."""
    import shutil

    k = RunKeys(run_name)
    truncated_run_shipped(tmp_path, redis_url, run_name, sim_factory, 40, shard_records=10)
    shutil.rmtree(tmp_path / "out")
    genq("requeue", "--set", "max_tokens=1200", "--redo", "truncated", "--continue",
         "--from-s3", URI, redis_url=redis_url, run=run_name)
    pending = r.hlen(k.partials)
    assert pending > 0
    r.delete(k.meta)  # the run is gone from Redis before any continuation ran
    genq("recover", "--from-s3", URI, redis_url=redis_url, run=run_name)
    assert r.hlen(k.partials) == pending


@pytest.mark.timeout(120)
def test_a_consumer_that_shipped_everything_and_exited_leaves_nothing_unshipped(
        tmp_path, redis_url, r, run_name, sim_factory, s3):
    """`unshipped` (what docs/SLURM.md tells operators to read before they let a node go) is
    0 for a consumer whose every shard reached S3, not the figure it last reported while its
    last shard was still open."""
    client, _ = s3
    n = 30
    start_run(tmp_path, redis_url, run_name, n)
    sim = sim_factory(time_scale=400, max_running_requests=8)
    c = consumer(redis_url, run_name, sim, tmp_path / "out", "--burst", "--shard-records", "7")
    try:
        assert c.wait(90) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    assert Counter(rec["index"] for rec in bucket_records(client, run_name)) == Counter(range(n))
    ship = orjson.loads(genq("status", "--json", redis_url=redis_url,
                             run=run_name).stdout)["shipping"]
    assert ship["records_shipped"] == n and ship["shards_pending"] == 0
    assert ship["unshipped"] == 0 and set(ship["unshipped_by_consumer"].values()) == {0}
