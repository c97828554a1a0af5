"""More shards than the process may open files (issue 21): `genq export`, `genq export
--from-s3`, the Parquet format and `genq recover` all read a run of 300 interleaved shards with
RLIMIT_NOFILE at 64, and write every index once, byte for byte what they write without the
limit."""

from __future__ import annotations

import resource
from pathlib import Path

import boto3
import orjson
import pytest
from conftest import free_port, genq
from faultkit import private_redis
from many_shards import write_run
from moto.server import ThreadedMotoServer
from pipeline import read_jsonl

from genq.common.data import manifest as manifests
from genq.common.store import s3 as store

PROMPTS, SHARDS, FILES = 3_000, 300, 64
BUCKET = "genq-many"
URI = f"s3://{BUCKET}/runs"


def few_files() -> None:
    """In the child, before exec: at most FILES open files."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILES, hard))


def limited(*args: str, redis_url: str, run: str):
    return genq(*args, redis_url=redis_url, run=run, check=False, timeout=120,
                preexec_fn=few_files)


def check_records(path: Path, run: str) -> None:
    """Every index once, in order, and the accepted attempt (2), never the zombie's (1)."""
    records = read_jsonl(path)
    assert [rec["index"] for rec in records] == list(range(PROMPTS))
    assert all(rec["attempt"] == 2 and rec["run"] == run for rec in records)


@pytest.fixture
def s3(monkeypatch):
    """moto's S3 server with a bucket, and AWS_* set so every genq process goes to it."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server._port}")
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    yield client
    server.stop()


@pytest.mark.timeout(180)
def test_export_reads_more_shards_than_it_may_open_files(tmp_path, redis_url, run_name):
    out = tmp_path / "out"
    write_run(out, run_name, PROMPTS, SHARDS)
    genq("recover", "--shards", str(out), redis_url=redis_url, run=run_name)
    reference = tmp_path / "reference.jsonl"
    genq("export", "--out", str(reference), redis_url=redis_url, run=run_name)
    got = tmp_path / "got.jsonl"
    proc = limited("export", "--out", str(got), redis_url=redis_url, run=run_name)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == (f"exported {PROMPTS} records ({PROMPTS} done of {PROMPTS}) from "
                           f"{SHARDS} shards to {got}\n")
    assert got.read_bytes() == reference.read_bytes()
    check_records(got, run_name)
    # Parquet goes through the same reading.
    import pyarrow.parquet as pq

    parquet = tmp_path / "got.parquet"
    proc = limited("export", "--format", "parquet", "--out", str(parquet),
                   redis_url=redis_url, run=run_name)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pq.read_table(parquet).to_pylist()
    assert [row["index"] for row in rows] == list(range(PROMPTS))
    assert [row["content"] for row in rows] == [rec["content"] for rec in read_jsonl(got)]


@pytest.mark.slow  # a soak of many shards
@pytest.mark.timeout(180)
def test_export_and_recover_from_s3_read_more_shards_than_they_may_open_files(
        tmp_path, redis_url, run_name, s3):
    out = tmp_path / "out"
    uri = store.parse_uri(URI)
    for path in write_run(out, run_name, PROMPTS, SHARDS):
        s3.put_object(Bucket=BUCKET, Key=store.shard_key(uri, path),
                      Body=store.compress(path.read_bytes()))
    s3.put_object(Bucket=BUCKET, Key=uri.key(run_name, "gpu0", store.MANIFEST),
                  Body=manifests.path(out, run_name).read_bytes())
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = limited("recover", "--from-s3", URI, "--shards", str(empty), redis_url=redis_url,
                   run=run_name)
    assert proc.returncode == 0 and f"{PROMPTS} of {PROMPTS} done" in proc.stdout, proc.stderr
    got = tmp_path / "got.jsonl"
    proc = limited("export", "--from-s3", URI, "--out", str(got), redis_url=redis_url,
                   run=run_name)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"from {SHARDS} shards" in proc.stdout
    check_records(got, run_name)
    local = tmp_path / "local.jsonl"  # the shards as written, exported from disk
    genq("export", "--shards", str(out), "--out", str(local), redis_url=redis_url,
         run=run_name)
    assert got.read_bytes() == local.read_bytes()


@pytest.mark.timeout(180)
def test_recover_after_redis_is_flushed_then_export_with_more_shards_than_open_files(
        tmp_path, run_name):
    out = tmp_path / "out"
    write_run(out, run_name, PROMPTS, SHARDS)
    with private_redis() as server:
        url = server.url
        genq("recover", "--shards", str(out), redis_url=url, run=run_name)
        reference = tmp_path / "reference.jsonl"
        genq("export", "--out", str(reference), redis_url=url, run=run_name)
        client = server.client()
        client.flushall()  # Redis lost everything
        client.close()
        proc = limited("recover", "--shards", str(out), redis_url=url, run=run_name)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"recovered run {run_name!r}: {PROMPTS} of {PROMPTS} done" in proc.stdout
        got = tmp_path / "got.jsonl"
        proc = limited("export", "--out", str(got), redis_url=url, run=run_name)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert got.read_bytes() == reference.read_bytes()
    check_records(got, run_name)
    assert orjson.loads(reference.read_bytes().splitlines()[0])["index"] == 0
