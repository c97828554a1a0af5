"""Capacity that tracks the server: one simulated server with 64 slots shared with another
client that keeps 16 requests in flight for the first half of a genq run, then leaves. Three
consumers side by side: tracking the server's load (the default), fixed at the server's max
(--concurrency 64), fixed at what was free at start (--concurrency 48). From the server's own
/v1/loads every 0.1 s: request-seconds waiting inside the server (late starts, for genq and
the neighbour), and slot-seconds idle while genq still had prompts to claim. Then two genq
runs sharing the server (tracking, and fixed at its max): does each get about half?

    python bench/capacity_tracking.py                  # 3000 prompts per variant, ~2 min
    python bench/capacity_tracking.py --n 300 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
from _common import (
    REPO,
    LoadSampler,
    RedisServer,
    Simulator,
    dump_json,
    env,
    genq,
    table,
    write_dataset,
)

from common.queue.keys import RunKeys

DECODE_TPS, TTFT = 87.5, 0.5  # the simulator's defaults


class Sampler(LoadSampler):
    """From a thread, every `period` s: the server's running and waiting requests, whether
    genq has started (a lease or a result in any of `runs`) and still has prompts nobody
    claimed (in any of them)."""

    def __init__(self, url: str, redis_url: str, runs: list[str], n: int, period: float
                 ) -> None:
        super().__init__([url], period)
        self.url, self.redis_url, self.keys = url, redis_url, [RunKeys(r) for r in runs]
        self.n = n
        self.samples: list[tuple[float, int, int, bool, bool]] = []  # type: ignore[assignment]

    def _run(self) -> None:
        import redis

        r = redis.Redis.from_url(self.redis_url)
        with httpx.Client(timeout=2.0) as client:
            while not self.stop.is_set():
                try:
                    rank = client.get(self.url + "/v1/loads").json()["loads"][0]
                except (httpx.HTTPError, ValueError, KeyError):
                    continue
                pipe = r.pipeline(transaction=False)
                for k in self.keys:
                    pipe.bitcount(k.done)
                    pipe.bitcount(k.failed)
                    pipe.zcard(k.leases)
                got = pipe.execute()
                counts = [got[i:i + 3] for i in range(0, len(got), 3)]
                started = any(done or leased for done, _, leased in counts)
                todo = any(self.n - sum(c) > 0 for c in counts)
                self.samples.append((time.monotonic() - self.t0, rank["num_running_reqs"],
                                     rank["num_waiting_reqs"], started, todo))
                self.stop.wait(self.period)
        r.close()


def integrate(samples: list[tuple], slots: int, t_end: float) -> dict[str, float]:
    """Each sample held until the next: waiting request-seconds from genq's first claim to its
    exit, idle slot-seconds from its first claim while it had prompts nobody claimed."""
    waiting = idle = 0.0
    start = next((s[0] for s in samples if s[3]), None)
    for (t, running, queued, started, todo), nxt in zip(samples, samples[1:], strict=False):
        dt = min(nxt[0], t_end) - t
        if not started or dt <= 0:
            continue
        waiting += queued * dt
        if todo:
            idle += max(0, slots - running) * dt
    return {"waiting_req_s": waiting, "idle_slot_s": idle,
            "first_claim_s": start if start is not None else 0.0}


def one_variant(a: argparse.Namespace, sim: Simulator, rs: RedisServer, dataset: Path,
                work: Path, label: str, concurrency: int | None) -> dict:
    run = f"cap-{label}"
    genq("produce", str(dataset), "--once", redis_url=rs.url, run=run)
    log = work / f"{label}.log"
    flags = ["--concurrency", str(concurrency)] if concurrency else []
    with Sampler(sim.url, rs.url, [run], a.n, a.sample) as sampler:
        # The neighbour is there first (genq finds 48 slots free), and leaves --foreign-s
        # after genq's first claim: for the first half of genq's run.
        neighbour = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "_foreign_client.py"), "--server", sim.url,
             "--inflight", str(a.foreign)],
            cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        t_start = time.monotonic() - sampler.t0
        with open(log, "wb") as out:
            consumer = subprocess.Popen(
                [sys.executable, "-m", "genq", "consume", "--server", sim.url, "--burst",
                 "--out", str(work / f"out-{label}"), "--name", label, *flags],
                cwd=REPO, env=env(rs.url, run), stdout=out, stderr=subprocess.STDOUT)
            while consumer.poll() is None and not any(s[3] for s in sampler.samples):
                time.sleep(0.01)
            time.sleep(a.foreign_s)
            neighbour.send_signal(signal.SIGTERM)
            rc = consumer.wait(timeout=600)
        t_exit = time.monotonic() - sampler.t0
        got, err = neighbour.communicate(timeout=120)
    if rc != 0 or neighbour.returncode != 0:
        raise RuntimeError(f"{label}: consumer exited {rc}, neighbour {neighbour.returncode}:\n"
                           f"{log.read_text(errors='replace')[-3000:]}\n{err.decode()[-2000:]}")
    figures = integrate(sampler.samples, a.max_running, t_exit)
    active = t_exit - figures["first_claim_s"]
    return {"label": label, "concurrency": concurrency, "wall_s": t_exit - t_start,
            "active_s": active, "tasks_per_s": a.n / active if active > 0 else 0.0,
            "slot_changes": slot_changes(log), "neighbour": json.loads(got), **figures,
            "samples": sampler.samples}


def slot_changes(log: Path) -> list[dict]:
    events = [orjson.loads(line) for line in log.read_bytes().splitlines()
              if line.startswith(b"{")]
    return [{k: e[k] for k in ("old", "new", "reason", "others")}
            for e in events if e.get("event") == "slots_changed"]


def one_pair(a: argparse.Namespace, sim: Simulator, rs: RedisServer, dataset: Path,
             work: Path, label: str, concurrency: int | None) -> dict:
    """Two genq runs on the same server (two consumers with --share-server, as two teams
    sharing a server would run), no neighbour: does each get about half?"""
    runs = [f"pair-{label}-{i}" for i in (0, 1)]
    for run in runs:
        genq("produce", str(dataset), "--once", redis_url=rs.url, run=run)
    flags = ["--concurrency", str(concurrency)] if concurrency else []
    logs = [work / f"{run}.log" for run in runs]
    with Sampler(sim.url, rs.url, runs, a.pair_n, a.sample) as sampler:
        procs = []
        for run, log in zip(runs, logs, strict=True):
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "genq", "consume", "--server", sim.url, "--burst",
                     "--share-server", "--out", str(work / f"out-{run}"), "--name", run,
                     *flags], cwd=REPO, env=env(rs.url, run), stdout=out,
                    stderr=subprocess.STDOUT))
        t_start = time.monotonic() - sampler.t0
        walls = []
        for proc, log in zip(procs, logs, strict=True):
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"{label}: a consumer exited {proc.returncode}:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
            walls.append(time.monotonic() - sampler.t0 - t_start)
        t_exit = time.monotonic() - sampler.t0
    return {"label": label, "concurrency": concurrency, "walls_s": walls,
            "slot_changes": [slot_changes(log) for log in logs],
            **integrate(sampler.samples, a.max_running, t_exit), "samples": sampler.samples}


def changes(got: list[dict]) -> str:
    """The slot counts in order, e.g. "64>48>64" (the start's count first)."""
    return ">".join(str(c) for c in [got[0]["old"]] + [c["new"] for c in got]) if got else "-"


def ratio(x: float, base: float) -> str:
    return f"{x / base:.2f}" if base > 0 else "-"


def report(a: argparse.Namespace, got: list[dict], d: float) -> None:
    after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\none simulated server, {a.max_running} slots, requests of ~{d:.2f} s (median); a "
          f"neighbour keeps {a.foreign} in flight until {a.foreign_s:.1f} s after genq's first "
          f"claim; genq runs {a.n} prompts with one `consume --burst`; {os.cpu_count()} cores, "
          f"load average before {a.load_before}, after {after}\n")
    rows = [(g["label"], f"{g['wall_s']:.1f}", f"{g['tasks_per_s']:.1f}",
             f"{g['waiting_req_s']:.1f}", f"{g['idle_slot_s']:.1f}", changes(g["slot_changes"]),
             g["neighbour"]["requests"], f"{g['neighbour']['mean_latency_s']:.3f}")
            for g in got]
    print(table(rows, ("variant", "wall s", "genq tasks/s", "server waiting req-s",
                       "idle slot-s (genq had work)", "slots", "neighbour requests",
                       "neighbour mean latency s")))
    base = got[0]
    print(f"\nratios against {base['label']}:\n")
    rows = [(g["label"], ratio(g["wall_s"], base["wall_s"]),
             ratio(g["tasks_per_s"], base["tasks_per_s"]),
             ratio(g["waiting_req_s"], base["waiting_req_s"]),
             ratio(g["idle_slot_s"], base["idle_slot_s"]),
             ratio(g["neighbour"]["mean_latency_s"], base["neighbour"]["mean_latency_s"]))
            for g in got[1:]]
    print(table(rows, ("variant", "wall", "genq tasks/s", "server waiting", "idle slots",
                       "neighbour latency")))


def report_pairs(a: argparse.Namespace, got: list[dict]) -> None:
    print(f"\ntwo genq runs of {a.pair_n} prompts each, one consumer each (--share-server), "
          f"started together on the same {a.max_running}-slot server, no neighbour:\n")
    rows = [(g["label"], " / ".join(f"{w:.1f}" for w in g["walls_s"]),
             f"{g['waiting_req_s']:.1f}", f"{g['idle_slot_s']:.1f}",
             " / ".join(spread(c) for c in g["slot_changes"]),
             " / ".join(str(len(c)) for c in g["slot_changes"]))
            for g in got]
    print(table(rows, ("variant", "wall s (each)", "server waiting req-s",
                       "idle slot-s (genq had work)", "slots, lowest-highest after the first "
                       "change", "slot changes")))


def spread(got: list[dict]) -> str:
    """The range a tracked count moved in once it first left the server's max, up to its last
    change (the raise back when the other run ended)."""
    counts = [c["new"] for c in got[:-1]]
    return f"{min(counts)}-{max(counts)}" if counts else "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=3000, help="prompts per variant (default 3000)")
    p.add_argument("--max-running", type=int, default=64, help="server slots (default 64)")
    p.add_argument("--foreign", type=int, default=16,
                   help="the neighbour's requests in flight (default 16)")
    p.add_argument("--foreign-s", type=float,
                   help="how long the neighbour stays after genq's first claim (default: half "
                        "of genq's ideal run at the server's max)")
    p.add_argument("--median-tokens", type=int, default=2326,
                   help="median answer length (default 2326, the real run's; lognormal)")
    p.add_argument("--time-scale", type=float, default=68.0,
                   help="simulator speed-up (default 68: ~0.4 s requests, 0.3-0.5 s mostly)")
    p.add_argument("--pair-n", type=int, default=1500,
                   help="prompts per run when two genq runs share the server (default 1500; "
                        "0 skips that part)")
    p.add_argument("--sample", type=float, default=0.1, help="load sampling period, s")
    p.add_argument("--json", help="also write the raw figures (and samples) here")
    a = p.parse_args()
    a.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    d = (TTFT + a.median_tokens / DECODE_TPS) / a.time_scale
    if a.foreign_s is None:
        a.foreign_s = a.n * d / a.max_running / 2
    variants = [("tracking", None), (f"fixed-{a.max_running}", a.max_running),
                (f"fixed-{a.max_running - a.foreign}", a.max_running - a.foreign)]
    work = Path(tempfile.mkdtemp(prefix="genq-bench-capacity-"))
    flags = ["--time-scale", str(a.time_scale), "--length-dist",
             f"lognormal:{a.median_tokens}:0.15", "--max-running-requests", str(a.max_running)]
    try:
        dataset = write_dataset(work / "prompts.jsonl", a.n)
        half = a.pair_n and write_dataset(work / "pair.jsonl", a.pair_n)
        with Simulator(*flags) as sim, RedisServer() as rs:
            got = [one_variant(a, sim, rs, dataset, work, label, c) for label, c in variants]
            pairs = [one_pair(a, sim, rs, half, work, label, c)
                     for label, c in variants[:2]] if half else []
        report(a, got, d)
        if pairs:
            report_pairs(a, pairs)
        dump_json(a.json, {"n": a.n, "max_running": a.max_running, "foreign": a.foreign,
                           "foreign_s": a.foreign_s, "request_s": d, "variants": got,
                           "pairs": pairs})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
