"""What a lost node costs against what shipping costs, by shard age (`--shard-minutes`): a
result is acknowledged once on the node's disk and reaches S3 when its shard closes, so a node
that dies loses at most the results of its open shards. Shorter shards bound that at the price
of more S3 requests and more consumer CPU per hour. For each shard age this measures, on
moto's S3 in its own process (so its CPU is not counted), the requests and the shipper's CPU
(compress, checksum, upload, verify) of one shard of that age at the seed's rate (answers of
~2.3k tokens, ~9 kB a record), and works them out per consumer-hour.

    python bench/ship_window.py [--rate 1.34] [--minutes 0.0125,0.5,1,2,5,10] [--shards 10]
                                [--gpus 8]
"""

from __future__ import annotations

import os
import random
import string
import subprocess
import sys
import time

import _common as kit
import orjson

from genq.common.net import free_port, wait_port
from genq.common.store import s3 as store

BUCKET = "genq-bench"
SHARD_RECORDS = 500  # genq consume's default --shard-records: a shard closes at this many too


def records(n: int) -> bytes:
    """n completions of ~2.3k tokens each (about 9 kB of random words), as shard lines."""
    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
             for _ in range(5000)]
    return b"".join(orjson.dumps({"index": i, "content": " ".join(rng.choices(words, k=1550)),
                                  "finish_reason": "stop"}) + b"\n" for i in range(n))


def ship(n_shards: int, raw: bytes, uri: store.S3Uri, tag: str) -> tuple[float, float]:
    """(CPU seconds, S3 requests) per shard, shipped one after another as one shipper does."""
    s3 = store.client()
    sent = [0]
    s3.meta.events.register("before-send.s3", lambda **_: sent.__setitem__(0, sent[0] + 1))
    cpu = time.process_time()
    for i in range(n_shards):
        store.put_verified(s3, uri, uri.key("bench", tag, f"shard-{i:06d}{store.SUFFIX}"),
                           store.compress(raw), {"records": "n"})
    return (time.process_time() - cpu) / n_shards, sent[0] / n_shards


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--rate", type=float, default=9.4 / 7,
                   help="results a second one consumer (one GPU) acknowledges: the seed's run "
                        "made 9.4 a second on 7 GPUs")
    # 0.0125 minutes holds one result: shipping each result before its ack, in effect.
    p.add_argument("--minutes", default="0.0125,0.5,1,2,5,10", help="shard ages to compare")
    p.add_argument("--shards", type=int, default=10, help="shards shipped per age")
    p.add_argument("--gpus", type=int, default=8, help="consumers a node runs, one per GPU")
    a = p.parse_args()
    port = free_port()
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows, figures = [], {"rate": a.rate, "gpus": a.gpus, "ages": []}
    try:
        wait_port(port, timeout=30)
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                          AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
        store.client().create_bucket(Bucket=BUCKET)
        uri = store.parse_uri(f"s3://{BUCKET}/bench")
        for minutes in (float(m) for m in a.minutes.split(",")):
            per_shard = max(1, min(SHARD_RECORDS, round(a.rate * 60 * minutes)))
            cpu_s, requests = ship(a.shards, records(per_shard), uri, f"m{minutes:g}")
            shards_h = a.rate * 3600 / per_shard  # a shard closes at its age or its records
            age = {"minutes": minutes, "records_per_shard": per_shard,
                   "cpu_ms_per_shard": cpu_s * 1e3, "requests_per_shard": requests,
                   "requests_per_hour": shards_h * requests, "cpu_s_per_hour": shards_h * cpu_s,
                   "at_risk_per_consumer": per_shard, "at_risk_per_node": per_shard * a.gpus}
            figures["ages"].append(age)
            rows.append((f"{minutes:g}", per_shard, f"{requests:.0f}",
                         f"{age['requests_per_hour']:.0f}", f"{age['cpu_ms_per_shard']:.1f}",
                         f"{age['cpu_s_per_hour']:.2f}", per_shard * a.gpus))
    finally:
        moto.terminate()
        moto.wait(10)
    print(f"one consumer at {a.rate:.2f} results/s; a node of {a.gpus} consumers; "
          f"{a.shards} shards shipped per age:")
    print(kit.table(rows, ("shard minutes", "records/shard", "S3 requests/shard",
                           "S3 requests/h/consumer", "CPU ms/shard", "CPU s/h/consumer",
                           "results at risk/node")))
    kit.dump_json(a.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
