"""Shipping shards to S3: upload throughput, the consumer's rate with and without shipping, and
the backlog through an S3 outage and the time to drain it after. S3 is moto's server on a free
port (`moto[server]`, a test extra) behind the tests' TCP fault proxy, so the outage is a real
refused connection; the figures measure genq's side (compression, checksums, Redis marking),
not a real S3's bandwidth.

    python bench/s3_shipping.py [--n 4000] [--rounds 1] [--outage 10] [--json FILE]
"""

from __future__ import annotations

import os
import random
import string
import sys
import time
from pathlib import Path

import _common as kit
import orjson
from faultkit import Background
from faultproxy import FaultProxy

from genq.common.net import free_port
from genq.common.queue.keys import RunKeys
from genq.common.store import s3 as store

BUCKET = "genq-bench"
SIM = ("--time-scale", "2000", "--ttft", "0", "--length-dist", "lognormal:2326:0.62",
       "--max-running-requests", "32")


def upload_round(n_shards: int, records: int, uri: store.S3Uri) -> dict:
    """Compress, upload and verify synthetic shards of `records` completions of ~2.3k tokens
    (about 9 kB of random words from a 5000-word vocabulary), one after another, as one
    shipper does."""
    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
             for _ in range(5000)]
    raw = b"".join(orjson.dumps({"index": i, "content": " ".join(rng.choices(words, k=1550)),
                                 "finish_reason": "stop"}) + b"\n" for i in range(records))
    s3 = store.client()
    started = time.monotonic()
    sent = 0
    for i in range(n_shards):
        body = store.compress(raw)
        store.put_verified(s3, uri, uri.key("bench", "c", f"shard-{i:06d}{store.SUFFIX}"), body,
                           {"records": str(records)})
        sent += len(body)
    seconds = time.monotonic() - started
    return {"shards_per_s": n_shards / seconds, "raw_mb_per_s": n_shards * len(raw) / seconds / 1e6,
            "sent_mb_per_s": sent / seconds / 1e6, "ratio": len(raw) * n_shards / sent}


def consume(rs, sim, data: Path, run: str, *flags: str) -> float:
    kit.genq("produce", str(data), "--once", redis_url=rs.url, run=run)
    started = time.monotonic()
    kit.genq("consume", "--server", sim.url, "--out", str(data.parent / run), "--burst", *flags,
             redis_url=rs.url, run=run)
    return time.monotonic() - started


def outage_round(rs, sim, data: Path, n: int, proxy: FaultProxy, s3_uri: str,
                 outage: float) -> dict:
    """A consumer shipping every 50 records; S3 refused for `outage` seconds mid-run."""
    run, r = "outage", rs.client()
    k = RunKeys(run)
    kit.genq("produce", str(data), "--once", redis_url=rs.url, run=run)
    consumer = Background(rs.url, run, "consume", "--server", sim.url, "--out",
                          str(data.parent / run), "--burst", "--s3-uri", s3_uri,
                          "--shard-records", "50")
    proc = consumer.proc

    def pending() -> int:
        return sum(int(v) for f, v in r.hgetall(k.ship).items() if f.startswith(b"pending|"))

    while int(r.hget(k.ship, "shards") or 0) < 2 and proc.poll() is None:
        time.sleep(0.05)
    proxy.set_mode("refuse")
    cut, done_at_cut, peak = time.monotonic(), r.bitcount(k.done), 0
    while time.monotonic() - cut < outage:
        peak = max(peak, pending())
        time.sleep(0.1)
    done_during = r.bitcount(k.done) - done_at_cut
    shipped_before = int(r.hget(k.ship, "shards") or 0)
    proxy.set_mode("pass")
    back, first = time.monotonic(), None
    while pending() and proc.poll() is None:
        peak = max(peak, pending())
        if first is None and int(r.hget(k.ship, "shards") or 0) > shipped_before:
            first = time.monotonic() - back
        time.sleep(0.05)
    drained = time.monotonic() - back
    shipped = int(r.hget(k.ship, "shards") or 0) - shipped_before
    proc.wait(timeout=300)
    consumer.cleanup()
    return {"peak_backlog_shards": peak, "done_during_outage": done_during,
            "first_ship_s": first or drained, "drain_s": drained, "shipped_while_draining":
            shipped, "exit": proc.returncode, "total": n}


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--n", type=int, default=4000, help="prompts per consumer run")
    p.add_argument("--shards", type=int, default=20, help="shards in the upload round")
    p.add_argument("--outage", type=float, default=10.0, help="seconds S3 is refused")
    p.add_argument("--rounds", type=int, default=1, help="ABBA rounds of the rate comparison")
    a = p.parse_args()
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    moto.start()
    proxy = FaultProxy(moto._port).start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=proxy.url("http", ""))
    store.client().create_bucket(Bucket=BUCKET)
    uri = store.parse_uri(f"s3://{BUCKET}/bench")
    figures: dict = {"upload": upload_round(a.shards, 500, uri)}
    with kit.workdir() as tmp, kit.private_redis() as rs, kit.simulators(1, *SIM) as [sim]:
        data = kit.write_dataset(tmp / "data.jsonl", a.n)
        # ABBA order, so a load change on a shared machine falls on both sides alike.
        got: dict = {"plain": [], "ship": []}
        for n, side in enumerate(("plain", "ship", "ship", "plain") * a.rounds):
            flags = ("--s3-uri", str(uri)) if side == "ship" else ()
            got[side].append(consume(rs, sim, data, f"{side}{n}", *flags))
        figures.update(plain_s=sum(got["plain"]), shipping_s=sum(got["ship"]),
                       runs_each=len(got["plain"]))
        figures["outage"] = outage_round(rs, sim, data, a.n, proxy, str(uri), a.outage)
    proxy.stop()
    moto.stop()
    report(a, figures)
    kit.dump_json(a.json, figures)
    return 0


def report(a, f: dict) -> None:
    u, o = f["upload"], f["outage"]
    print(f"upload, {a.shards} shards of 500 records (~{u['ratio']:.1f}x compression):")
    print(kit.table([(f"{u['shards_per_s']:.1f}", f"{u['raw_mb_per_s']:.1f}",
                      f"{u['sent_mb_per_s']:.2f}")], ("shards/s", "raw MB/s", "compressed MB/s")))
    runs = f["runs_each"]
    print(f"\nconsume --burst, {a.n} prompts, {runs} runs each (ABBA):")
    print(kit.table([(f"{runs * a.n / f['plain_s']:.0f}", f"{runs * a.n / f['shipping_s']:.0f}",
                      f"{f['plain_s'] / f['shipping_s']:.2f}")],
                    ("tasks/s, no S3", "tasks/s, --s3-uri", "ratio")))
    print(f"\nS3 refused for {a.outage:g} s mid-run (shards of 50 records):")
    print(kit.table([(o["peak_backlog_shards"], o["done_during_outage"], f"{o['first_ship_s']:.1f}",
                      f"{o['drain_s']:.1f}", o["shipped_while_draining"], o["exit"])],
                    ("peak backlog (shards)", "done during outage", "first upload after (s)",
                     "backlog 0 after (s)", "shards shipped meanwhile", "exit")))


if __name__ == "__main__":
    sys.exit(main())
