"""Shipping shards to S3 (moto behind the tests' fault proxy, so an outage refuses; genq's side,
not S3's bandwidth). --ages: instead, by shard age (`--shard-minutes`), moto in its own process.

    python bench/s3_shipping.py [--n 4000] [--outage 10]
    python bench/s3_shipping.py --ages [0.0125,0.5,1,2,5,10] [--rate 1.34] [--gpus 8]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import _common as kit
from faultkit import Background
from faultproxy import FaultProxy

from genq.common.queue.keys import RunKeys
from genq.common.store import s3 as store

BUCKET = "genq-bench"
SIM = ("--time-scale", "2000", "--ttft", "0", "--length-dist", "lognormal:2326:0.62",
       "--max-running-requests", "32")
SHARD_RECORDS = 500  # genq consume's default --shard-records: a shard closes at this many too


def ship(n_shards: int, raw: bytes, uri: store.S3Uri, tag: str) -> dict:
    """Shards compressed, uploaded and verified one after another, as one shipper does."""
    s3, sent, requests = store.client(), 0, [0]
    s3.meta.events.register("before-send.s3", lambda **_: requests.__setitem__(0, requests[0] + 1))
    started, cpu = time.monotonic(), time.process_time()
    for i in range(n_shards):
        body = store.compress(raw)
        store.put_verified(s3, uri, uri.key("bench", tag, f"shard-{i:06d}{store.SUFFIX}"), body,
                           {"records": "n"})
        sent += len(body)
    return {"cpu_s": (time.process_time() - cpu) / n_shards, "requests": requests[0] / n_shards,
            "wall_s": time.monotonic() - started, "sent": sent}


def upload_round(n_shards: int, uri: store.S3Uri) -> dict:
    raw = kit.synthetic_records(SHARD_RECORDS)
    got = ship(n_shards, raw, uri, "c")
    seconds, sent = got["wall_s"], got["sent"]
    return {"shards_per_s": n_shards / seconds, "raw_mb_per_s": n_shards * len(raw) / seconds / 1e6,
            "sent_mb_per_s": sent / seconds / 1e6, "ratio": len(raw) * n_shards / sent}


def ages(a) -> dict:
    figures: dict = {"rate": a.rate, "gpus": a.gpus, "ages": []}
    with kit.moto_s3(BUCKET, own_process=True):
        uri = store.parse_uri(f"s3://{BUCKET}/bench")
        for minutes in (float(m) for m in a.ages.split(",")):
            per_shard = max(1, min(SHARD_RECORDS, round(a.rate * 60 * minutes)))
            got = ship(a.shards, kit.synthetic_records(per_shard), uri, f"m{minutes:g}")
            shards_h = a.rate * 3600 / per_shard  # a shard closes at its age or its records
            figures["ages"].append({
                "minutes": minutes, "records_per_shard": per_shard,
                "cpu_ms_per_shard": got["cpu_s"] * 1e3, "requests_per_shard": got["requests"],
                "requests_per_hour": shards_h * got["requests"],
                "cpu_s_per_hour": shards_h * got["cpu_s"], "at_risk_per_node": per_shard * a.gpus})
    print(f"one consumer at {a.rate:.2f} results/s; a node of {a.gpus} consumers; "
          f"{a.shards} shards shipped per age:")
    print(kit.table([(f"{x['minutes']:g}", x["records_per_shard"],
                      f"{x['requests_per_shard']:.0f}", f"{x['requests_per_hour']:.0f}",
                      f"{x['cpu_ms_per_shard']:.1f}", f"{x['cpu_s_per_hour']:.2f}",
                      x["at_risk_per_node"]) for x in figures["ages"]],
                    ("shard minutes", "records/shard", "S3 requests/shard",
                     "S3 requests/h/consumer", "CPU ms/shard", "CPU s/h/consumer",
                     "results at risk/node")))
    return figures


def consume(rs, sim, data: Path, run: str, *flags: str) -> float:
    kit.produce_once(rs.url, run, data)
    started = time.monotonic()
    kit.genq("consume", "--server", sim.url, "--out", str(data.parent / run), "--burst", *flags,
             redis_url=rs.url, run=run)
    return time.monotonic() - started


def outage_round(rs, sim, data: Path, n: int, proxy: FaultProxy, s3_uri: str,
                 outage: float) -> dict:
    run, r = "outage", rs.client()
    k = RunKeys(run)
    kit.produce_once(rs.url, run, data)
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
    p.add_argument("--shards", type=int, help="shards shipped (default 20; --ages: 10 an age)")
    p.add_argument("--outage", type=float, default=10.0, help="seconds S3 is refused")
    p.add_argument("--ages", nargs="?", const="0.0125,0.5,1,2,5,10",
                   help="instead: these shard ages (minutes) compared")
    p.add_argument("--rate", type=float, default=9.4 / 7,
                   help="--ages: results a second a GPU (the seed: 9.4 a second on 7 GPUs)")
    p.add_argument("--gpus", type=int, default=8, help="--ages: consumers a node runs")
    a = p.parse_args()
    a.shards = a.shards or (10 if a.ages else 20)
    if a.ages:
        kit.dump_json(a.json, ages(a))
        return 0
    with kit.moto_s3(BUCKET) as port:
        proxy = FaultProxy(port).start()
        os.environ["AWS_ENDPOINT_URL"] = proxy.url("http", "")
        uri = store.parse_uri(f"s3://{BUCKET}/bench")
        figures: dict = {"upload": upload_round(a.shards, uri)}
        with kit.workdir() as tmp, kit.private_redis() as rs, kit.simulators(1, *SIM) as [sim]:
            data = kit.write_dataset(tmp / "data.jsonl", a.n)
            # ABBA order, so a load change on a shared machine falls on both sides alike.
            got: dict = {"plain": [], "ship": []}
            for n, side in enumerate(("plain", "ship", "ship", "plain")):
                flags = ("--s3-uri", str(uri)) if side == "ship" else ()
                got[side].append(consume(rs, sim, data, f"{side}{n}", *flags))
            figures.update(plain_s=sum(got["plain"]), shipping_s=sum(got["ship"]),
                           runs_each=len(got["plain"]))
            figures["outage"] = outage_round(rs, sim, data, a.n, proxy, str(uri), a.outage)
        proxy.stop()
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
