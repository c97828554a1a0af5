"""The seed run replayed time-scaled: 7 servers x 40 slots, its lengths (lognormal:2326:0.62,
~18 % truncated at 4096), the pivot to max_tokens 8192 a third of the way in, three ways on
fresh servers and Redis: `genq requeue --set max_tokens=8192 --redo truncated` on the live run;
the same with `--continue`; by hand (SIGKILL every consumer, a pause, the requeue, relaunch).
Wall to the finished data set, GPU-idle seconds (the servers' running counts), tokens thrown away.

    python bench/replay_story.py                     # 4200 prompts, ~3 x 40 s
    python bench/replay_story.py --prompts 14000 --json out.json
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _common as kit
import httpx
import orjson
from pipeline import wait_for

DECODE_TPS = 87.5  # the simulator's default; a running slot makes this many tokens/s x scale
PIVOT = ("requeue", "--set", "max_tokens=8192", "--redo", "truncated")


def pivot(redis_url: str, *extra: str) -> float:
    """`genq requeue` in this process (a subprocess's start-up: minutes of a time-scaled run)."""
    from genq.cli import main as genq_main
    t0 = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = genq_main([*PIVOT, *extra, "--redis-url", redis_url, "--run", "story"])
    if rc:
        raise RuntimeError(f"genq requeue exited {rc}")
    return time.monotonic() - t0


class Fleet:
    def __init__(self, a, rs, sims: list, work: Path, tag: str) -> None:
        self.logs = [work / f"{tag}-consumer{i}.log" for i in range(len(sims))]
        self.procs = [kit.consumer(rs.url, "story", "--server", sim.url, "--burst", "--out",
                                   str(work / f"{tag}-out{i}"), "--name", f"{tag}{i}",
                                   "--visibility-timeout", str(a.visibility_timeout), log=log)
                      for i, (sim, log) in enumerate(zip(sims, self.logs, strict=True))]

    def kill(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait(timeout=30)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc, log in zip(self.procs, self.logs, strict=True):
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                rc = "nothing (killed after the timeout)"
            if rc != 0:
                raise RuntimeError(f"consumer exited {rc}:\n{log.read_text()[-4000:]}")


def one_way(a, way: str, dataset: Path, work: Path) -> dict:
    flags = ["--time-scale", str(a.time_scale), "--length-dist", "lognormal:2326:0.62",
             "--max-running-requests", str(a.slots), "--reasoning-parser", "qwen3"]
    with kit.simulators(a.servers, *flags) as sims, kit.private_redis() as rs:
        kit.produce_once(rs.url, "story", dataset, "--max-tokens", "4096")
        r = rs.client()
        with kit.LoadSampler([s.url for s in sims], period=a.sample) as sampler:
            t0 = time.monotonic()
            fleet = Fleet(a, rs, sims, work, way)
            wait_for(lambda: r.bitcount("genq:story:done") >= a.prompts // 3,
                     timeout=a.timeout, what="a third of the prompts done")
            t_pivot = time.monotonic() - sampler.t0
            if way == "hand":
                fleet.kill()
                time.sleep(a.hand_delay)
            pivot_s = pivot(rs.url, *(["--continue"] if way == "continue" else []))
            if way == "hand":
                fleet = Fleet(a, rs, sims, work, way + "-relaunched")
            fleet.wait(timeout=a.timeout)
            wall = time.monotonic() - t0
        kept = export_tokens(rs, work / f"{way}.jsonl", a.prompts)
        r.close()
        stats = [httpx.get(s.url + "/_sim/stats").json() for s in sims]
    return {**figures(a, way, sampler, t_pivot, wall, kept, stats), "pivot_s": pivot_s}


def export_tokens(rs, out: Path, n: int) -> dict:
    kit.genq("export", "--out", str(out), redis_url=rs.url, run="story")
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    if sorted(rec["index"] for rec in records) != list(range(n)):
        raise RuntimeError(f"export holds {len(records)} records, expected every one of {n}")
    return {"tokens": sum(rec["completion_tokens"] for rec in records),
            "v2": sum(rec["params_version"] == 2 for rec in records),
            "continued": sum("continued_from" in rec for rec in records),
            "prefix_tokens": sum(rec.get("continued_from", {}).get("tokens", 0)
                                 for rec in records),
            "length": sum(rec["finish_reason"] == "length" for rec in records)}


def figures(a, way: str, sampler: kit.LoadSampler, t_pivot: float,
            wall: float, kept: dict, stats: list[dict]) -> dict:
    lo, hi = t_pivot - a.around / 2, t_pivot + a.around
    idle_pivot = sum(kit.slot_seconds(s, a.slots, lo, hi)[0] for s in sampler.samples) / a.slots
    idle_run = sum(kit.slot_seconds(s, a.slots, *kit.full_window(s, a.slots))[0]
                   for s in sampler.samples) / a.slots
    busy_slot_s = sum(running * (t1 - t0) for s in sampler.samples
                      for (t0, running, _), (t1, _, _) in zip(s, s[1:], strict=False))
    completed = sum(x["output_tokens"] for x in stats)
    return {"way": way, "wall_s": wall, "t_pivot": t_pivot,
            "gpu_idle_s_around_pivot": idle_pivot, "gpu_idle_s_run": idle_run,
            "tokens_completed": completed, "tokens_kept": kept["tokens"],
            "tokens_busy_estimate": busy_slot_s * DECODE_TPS * a.time_scale,
            "aborted": sum(x["aborted"] for x in stats),
            "requests": sum(x["received"] for x in stats), **kept}


def report(a, g: dict, c: dict, h: dict) -> None:
    s = a.time_scale
    for way in (g, c, h):
        way["thrown"] = way["tokens_busy_estimate"] - way["tokens_kept"]

    def row(label: str, key: str, fmt: str, scale: float = 1.0) -> tuple:
        return (label, *(format(way[key] * scale, fmt) for way in (g, c, h)))

    rows = [
        row("wall s to the finished data set", "wall_s", ".1f"),
        row("  same, in real-run hours (x time scale / 3600)", "wall_s", ".2f", s / 3600),
        row(f"GPU-idle s around the pivot ({a.around / 2:.0f} s before, {a.around:.0f} s "
            "after), all GPUs", "gpu_idle_s_around_pivot", ".1f"),
        row("  same, in real-run GPU-minutes (x time scale / 60)", "gpu_idle_s_around_pivot",
            ".1f", s / 60),
        row("GPU-idle s over the run while work remained", "gpu_idle_s_run", ".1f"),
        row("requests sent", "requests", ".0f"),
        row("requests aborted mid-generation", "aborted", ".0f"),
        row("tokens in completed requests (simulator counters)", "tokens_completed", ".0f"),
        row("tokens generated, incl. aborted partials (busy slot-s x rate)",
            "tokens_busy_estimate", ".0f"),
        row("tokens kept in the data set", "tokens_kept", ".0f"),
        row("tokens thrown away (generated - kept)", "thrown", ".0f"),
        row("answers continued from their partial", "continued", ".0f"),
        row("  their partials' tokens, not decoded again", "prefix_tokens", ".0f"),
        row("results under max_tokens 8192 (version 2)", "v2", ".0f"),
        row("the requeue command itself, ms", "pivot_s", ".0f", 1000),
        row("results still truncated (`length`)", "length", ".0f"),
    ]
    print(f"\n{a.prompts} prompts, {a.servers} servers x {a.slots} slots, lognormal:2326:0.62, "
          f"max_tokens 4096 -> 8192 after {a.prompts // 3} done, time scale {s:g}, by-hand "
          f"pause {a.hand_delay:g} s (= {a.hand_delay * s / 60:.0f} real minutes), lease "
          f"{a.visibility_timeout:g} s; {os.cpu_count()} cores, load average before: "
          f"{a.load_before}, after: {kit.load_average()}\n")
    print(kit.table(rows, ("figure", "genq requeue", "genq requeue --continue",
                           "by hand (kill, relaunch)")))


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--prompts", type=int, default=4200)
    p.add_argument("--servers", type=int, default=7)
    p.add_argument("--slots", type=int, default=40, help="slots per server")
    p.add_argument("--time-scale", type=float, default=20.0, help="simulator speed-up")
    p.add_argument("--hand-delay", type=float, default=6.0, help="seconds killed, by hand")
    p.add_argument("--visibility-timeout", type=float, default=10.0)
    p.add_argument("--around", type=float, default=10.0, help="s after the pivot (half before)")
    p.add_argument("--sample", type=float, default=0.1, help="load sampling period, s")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a way may take")
    a = p.parse_args()
    a.load_before = kit.load_average()
    import genq.producer.requeue  # noqa: F401  (imported now, not at the pivot)
    with kit.workdir() as work:
        dataset = kit.write_dataset(work / "prompts.jsonl", a.prompts)
        ways: dict = {}
        for way in ("genq", "continue", "hand"):
            ways[way] = one_way(a, way, dataset, work)
            print(f"{way}: {ways[way]['wall_s']:.1f} s", file=sys.stderr)
    report(a, *ways.values())
    kit.dump_json(a.json, {**ways, "args": vars(a)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
