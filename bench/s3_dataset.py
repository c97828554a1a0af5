"""A data set read from S3 alone: `genq produce s3://…` and a consumer on a machine with an
empty cache, on the seed's scale (914,000 agentic conversations: system prompt, task, a tool
call, its result, an answer, a follow-up). S3 is moto's server on a free port; the figures are
genq's side (download, fingerprint, index), not a real S3's bandwidth. Reports the producer's
wall, the consumer's time from start to its first result and its peak memory (VmHWM) after
`--seconds` of work.

    python bench/s3_dataset.py [--rows 914000] [--format parquet|jsonl] [--json FILE]
"""

from __future__ import annotations

import logging
import os
import random
import signal
import string
import sys
import time

import _common as kit
import orjson

from genq.common.net import free_port
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
    """The data set, 10,000 rows at a time (Parquet: one row group each)."""
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


def vm_hwm_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--rows", type=int, default=914_000)
    p.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    p.add_argument("--seconds", type=float, default=20, help="consumer's work before its stop")
    a = p.parse_args()
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log, a line a GET
    moto.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{moto._port}")
    import boto3
    from botocore.config import Config

    # The bench's own client: moto assembles a big multipart upload slower than genq's timeout.
    s3 = boto3.client("s3", config=Config(read_timeout=600))
    s3.create_bucket(Bucket=BUCKET)
    f: dict = {"rows": a.rows, "format": a.format}
    with kit.workdir() as tmp, kit.private_redis() as rs, \
            kit.simulators(1, "--time-scale", "400") as [sim]:
        local = tmp / f"prompts.{a.format}"
        write(local, a.rows, a.format)
        f["mb"] = local.stat().st_size / 1e6
        s3.upload_file(str(local), BUCKET, local.name)
        local.unlink()  # from here on the data set is in S3 alone
        uri, r, done = f"s3://{BUCKET}/{local.name}", rs.client(), RunKeys("s3ds").done
        started = time.monotonic()
        os.environ["XDG_CACHE_HOME"] = str(tmp / "a")  # the producer's machine
        kit.genq("produce", uri, "--once", redis_url=rs.url, run="s3ds")
        f["produce_s"] = time.monotonic() - started
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
    moto.stop()
    print(kit.table([(f"{a.rows:,} {a.format}", f"{f['mb']:.0f}", f"{f['produce_s']:.1f}",
                      f"{f['first_result_s']:.1f}", f["done"], f"{f['consumer_peak_mb']:.0f}")],
                    ("data set", "MB", "produce (s)", "consumer: first result (s)",
                     "results", "consumer peak (MB)")))
    kit.dump_json(a.json, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
