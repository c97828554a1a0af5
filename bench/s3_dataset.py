"""A data set of agentic conversations in S3 alone (moto; genq's side, not S3's bandwidth):
`genq produce s3://… --once` to `run_registered` and to its exit; a consumer on an empty cache to
its first result, its peak memory (VmHWM) after `--seconds`. `--baseline`: three copies first.

    python bench/s3_dataset.py [--rows 914000] [--format parquet|jsonl] [--data DIR] [--baseline]
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import _common as kit
import orjson

from genq.common.queue.keys import RunKeys

BUCKET = "genq-bench"
SYSTEM = "You are a coding agent. Use the tools to read, edit and test files. " * 6
# Text that compresses as real conversations do, not as one sentence repeated: ~1.6 kB a row.
_RNG = random.Random(0)
_WORDS = ["".join(_RNG.choices(string.ascii_lowercase, k=_RNG.randint(2, 9))) for _ in range(5000)]
TEXT = [" ".join(_RNG.choices(_WORDS, k=100)) for _ in range(9973)]


def row(i: int) -> dict:
    call = {"id": f"c{i}", "type": "function",
            "function": {"name": "read_file", "arguments": orjson.dumps({"path": f"src/m{i}.py"})
                         .decode()}}
    return {"id": f"p{i}", "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task {i}: {TEXT[i % 9973]}"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": TEXT[i * 7 % 9973]},
        {"role": "assistant", "content": TEXT[i * 13 % 9973]},
        {"role": "user", "content": "Now write the patch and run the tests."}]}


def write(path, rows: int, fmt: str) -> None:
    """10,000 rows at a time (Parquet: a row group each)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer = None
    with open(path, "wb") as f:
        for start in range(0, rows, 10_000):
            batch = [row(i) for i in range(start, min(rows, start + 10_000))]
            if fmt == "jsonl":
                f.write(b"".join(orjson.dumps(r) + b"\n" for r in batch))
                continue
            table = pa.Table.from_pylist(batch)
            writer = writer or pq.ParquetWriter(f, table.schema, compression="zstd")
            writer.write_table(table)
        if writer:
            writer.close()


def generated(folder: Path, rows: int, fmt: str) -> Path:
    path = folder / f"prompts-{rows}.{fmt}"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        write(tmp, rows, fmt)
        os.replace(tmp, path)
    return path


def produce(uri: str, redis_url: str) -> tuple[float, float]:
    """`genq produce URI --once`: seconds to its `run_registered` line, and to its exit."""
    started, registered = time.monotonic(), None
    proc = subprocess.Popen([sys.executable, "-m", "genq", "produce", uri, "--once"],
                            cwd=kit.REPO, env=kit.genq_env(redis_url, "s3ds"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr
    for line in proc.stderr:
        if registered is None and b"run_registered" in line:
            registered = time.monotonic() - started
    if proc.wait() != 0 or registered is None:
        raise SystemExit(f"genq produce {uri} --once exited {proc.returncode}")
    return registered, time.monotonic() - started


def copies(uri: str, tmp: Path) -> dict[str, float]:
    from boto3.s3.transfer import TransferConfig

    from genq.common.data import remote
    from genq.common.store import s3 as store

    where, client, out = store.parse_uri(uri), store.client(), tmp / "copy"
    seconds = {}

    def timed(way: str, copy) -> None:
        started = time.monotonic()
        copy()
        seconds[way] = time.monotonic() - started
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()

    def one_stream() -> None:
        body = client.get_object(Bucket=where.bucket, Key=where.prefix)["Body"]
        with open(out / "one", "wb") as f:
            for chunk in body.iter_chunks(1 << 20):
                f.write(chunk)

    out.mkdir()
    timed("boto3 download_file, 16 MB parts x 4 threads",
          lambda: client.download_file(where.bucket, where.prefix, str(out / "parts"), Config=
                                       TransferConfig(multipart_chunksize=16 << 20,
                                                      max_concurrency=4)))
    os.environ["XDG_CACHE_HOME"] = str(out)
    timed("genq remote.local_copy", lambda: remote.local_copy(uri))
    timed("one get_object stream", one_stream)
    return seconds


def vm_hwm_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--rows", type=int, default=914_000)
    p.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    p.add_argument("--seconds", type=float, default=20, help="consumer's work before its stop")
    p.add_argument("--baseline", action="store_true", help="also time three copies")
    p.add_argument("--data", help="a folder keeping the generated data set for the next run")
    a = p.parse_args()
    import boto3
    from botocore.config import Config

    f: dict = {"rows": a.rows, "format": a.format}
    with kit.moto_s3(BUCKET), kit.workdir() as tmp, kit.private_redis() as rs, \
            kit.simulators(1, "--time-scale", "400") as [sim]:
        # Its own client: moto assembles a big multipart upload slower than genq's timeout.
        s3 = boto3.client("s3", config=Config(read_timeout=600))
        local = generated(Path(a.data) if a.data else tmp, a.rows, a.format)
        f["mb"] = local.stat().st_size / 1e6
        s3.upload_file(str(local), BUCKET, local.name)
        if not a.data:
            local.unlink()  # from here on the data set is in S3 alone
        uri, r, done = f"s3://{BUCKET}/{local.name}", rs.client(), RunKeys("s3ds").done
        f["load_before"] = os.getloadavg()
        if a.baseline:
            f["copy_s"] = copies(uri, tmp)
        os.environ["XDG_CACHE_HOME"] = str(tmp / "a")  # the producer's machine
        f["registered_s"], f["produce_s"] = produce(uri, rs.url)
        started = time.monotonic()
        c = kit.consumer(rs.url, "s3ds", "--server", sim.url, "--out", str(tmp / "out"),
                         env={"XDG_CACHE_HOME": str(tmp / "b")})
        while not r.bitcount(done) and c.poll() is None:
            time.sleep(0.05)
        f["first_result_s"] = time.monotonic() - started
        time.sleep(a.seconds)
        f["done"], f["consumer_peak_mb"] = r.bitcount(done), vm_hwm_mb(c.pid)
        c.send_signal(signal.SIGTERM)
        c.wait(60)
        f["load_after"] = os.getloadavg()
    print(kit.table([(f"{a.rows:,} {a.format}", f"{f['mb']:.0f}", f"{f['registered_s']:.1f}",
                      f"{f['produce_s']:.1f}", f"{f['first_result_s']:.1f}", f["done"],
                      f"{f['consumer_peak_mb']:.0f}")],
                    ("data set", "MB", "produce: registered (s)", "produce --once (s)",
                     "consumer: first result (s)", "results", "consumer peak (MB)")))
    for way, seconds in f.get("copy_s", {}).items():
        print(f"copy, {way}: {seconds:.2f} s ({f['mb'] / seconds:.0f} MB/s)")
    print("load average before {:.1f} {:.1f} {:.1f}, after {:.1f} {:.1f} {:.1f}".format(
        *f["load_before"], *f["load_after"]))
    kit.dump_json(a.json, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
