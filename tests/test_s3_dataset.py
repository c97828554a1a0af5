"""The data set copy from S3 against moto through an HTTP fault proxy: S3 throttling a range,
a store that ignores Range, and an object replaced between two nodes' copies."""

from __future__ import annotations

import os

import boto3
import pytest
from conftest import free_port, genq
from moto.server import ThreadedMotoServer
from pipeline import ConsumerProcess
from s3faults import S3Faults

from genq.common.data import remote
from genq.common.data.dataset import open_dataset
from genq.common.errors import DatasetError
from genq.common.queue import run as runs
from genq.common.queue.keys import RunKeys

BUCKET = "genq-data"


@pytest.fixture
def s3(monkeypatch, tmp_path):
    """moto's S3 server, a bucket, the fault proxy in front; AWS_* point every genq process at
    the proxy and the copy cache is the test's own. Yields (direct client, proxy)."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    faults = S3Faults(server._port).start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", faults.url)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    direct = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{server._port}")
    direct.create_bucket(Bucket=BUCKET)
    yield direct, faults
    faults.stop()
    server.stop()


def copies() -> list[str]:
    """The finished copies in this machine's cache (not locks, not temporary files)."""
    where = remote.cache_dir()
    return sorted(p.name for p in where.iterdir()
                  if not p.name.endswith((".lock", ".tmp"))) if where.exists() else []


@pytest.mark.timeout(60)
def test_a_throttled_range_is_asked_again_and_the_copy_is_whole(s3):
    """S3 answers 503 SlowDown, then 500, to the range's GET (a fleet starting together is when
    it throttles): the copy backs off, asks again, and comes out whole and exact."""
    client, faults = s3
    data = os.urandom(3 << 20)
    client.put_object(Bucket=BUCKET, Key="d.jsonl", Body=data)
    faults.failures = [503, 500]
    path, _ = remote.local_copy(f"s3://{BUCKET}/d.jsonl")
    assert path.read_bytes() == data
    assert faults.gets == 3 and not faults.failures


@pytest.mark.timeout(60)
def test_a_killed_download_leaves_no_temporary_file_behind(s3):
    """A download killed mid-way (a preempted task) leaves its temporary file; the next copy
    of the same object on the machine removes it."""
    client, _ = s3
    data = os.urandom(1 << 20)
    client.put_object(Bucket=BUCKET, Key="d.jsonl", Body=data)
    path, _ = remote.local_copy(f"s3://{BUCKET}/d.jsonl")
    leftover = path.with_name(f"{path.name}.999999.tmp")
    leftover.write_bytes(data[:1000])
    path.unlink()
    assert remote.local_copy(f"s3://{BUCKET}/d.jsonl")[0].read_bytes() == data
    assert not leftover.exists()


@pytest.mark.timeout(60)
def test_a_store_that_ignores_range_is_refused_and_nothing_is_cached(s3):
    """A store that answers a ranged GET with the whole object would give a resumed or
    parallel copy the wrong bytes at the right size: refused in one line, nothing cached."""
    client, faults = s3
    client.put_object(Bucket=BUCKET, Key="d.jsonl", Body=os.urandom(1 << 20))
    faults.ignore_range = True
    with pytest.raises(DatasetError, match="ignores Range"):
        remote.local_copy(f"s3://{BUCKET}/d.jsonl")
    assert copies() == []


def two_versions() -> tuple[bytes, bytes]:
    """Two JSON lines data sets of the same size, rows and first and last MiB, which differ
    in one row in the middle: the same fingerprint, other prompts."""
    rows = [b'{"prompt": "row %05d %s"}\n' % (i, b"x" * 900) for i in range(3000)]
    first = b"".join(rows)
    rows[1500] = rows[1500].replace(b"x" * 900, b"y" * 900)
    return first, b"".join(rows)


@pytest.mark.timeout(120)
def test_every_node_copies_the_version_the_run_registered(
        tmp_path, redis_url, r, run_name, sim_factory, s3, monkeypatch):
    """The object is replaced by a version of the same size and edges after the run was
    registered: a node that already copied the registered version keeps serving it, and a
    node that would copy the new one refuses in one line instead of serving other prompts."""
    client, _ = s3
    first, second = two_versions()
    uri = f"s3://{BUCKET}/data/prompts.jsonl"
    client.put_object(Bucket=BUCKET, Key="data/prompts.jsonl", Body=first)
    genq("produce", uri, "--once", redis_url=redis_url, run=run_name)
    client.put_object(Bucket=BUCKET, Key="data/prompts.jsonl", Body=second)

    # This machine copied the registered version when the producer started: it still serves it.
    info = runs.load(r, RunKeys(run_name))
    ds = open_dataset(info.dataset, version=info.dataset_version)
    assert "x" * 900 in ds.prompt(1500).messages[0]["content"]
    ds.close()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "node2-cache"))
    sim = sim_factory(time_scale=400)
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "node2", "--burst")
    try:
        assert c.wait(60) != 0
        log = c.log()
    finally:
        c.cleanup()
    assert "not the version the run registered" in log and "Traceback" not in log, log[-2000:]
    assert copies() == []
