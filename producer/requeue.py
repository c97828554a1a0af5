"""`genq requeue`: new parameters for a live run, and optionally finished prompts run again
under them, without restarting anything or losing finished work."""

from __future__ import annotations

import argparse
import sys

import redis
from rich.progress import Progress

from common import params
from common import run as runs
from common.cli import add_common, connect, guarded, run_keys
from common.errors import UsageError
from common.keys import RunKeys
from common.scripts import ScriptRunner, redo_call
from producer import probe

# Indices made runnable per redo script call: each call is atomic and exact, and at about
# 9 us an index (bench/redo_scale.py) holds Redis for under 0.1 s, so acks are not held up.
REDO_LIMIT = 10_000
# What each --redo mode walks: result bitmaps to undo, then failed prompts to revive.
REDO_PASSES = {"truncated": ("truncated",), "failed": ("failed",), "all": ("done", "failed")}

def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="genq requeue", description=__doc__)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="parameter to change (max_tokens, temperature, top_p, model, "
                        "enable_thinking, ...); repeatable")
    p.add_argument("--redo", choices=["none", "truncated", "failed", "all"], default="none",
                   help="also run again: results that hit max_tokens, failed prompts, or all")
    p.add_argument("--inflight", choices=["abort", "finish"], default="abort",
                   help="requests running under older parameters: abort and requeue them "
                        "(default) or let them finish")
    p.add_argument("--probe", type=_positive, metavar="N",
                   help="change nothing: run N of the prompts the redo would run (default: "
                        "the truncated) under --set, report truncation, lengths, cost and "
                        "ETA, and keep the answers for the commit (docs/CLI-EXTENSIONS.md)")
    p.add_argument("--probe-concurrency", type=_positive, default=4, metavar="C",
                   help="probe requests at once per server (default 4)")
    p.add_argument("--json", action="store_true", help="with --probe: one JSON object")
    add_common(p)
    return p.parse_args(argv)


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of at least 1")
    return n


@guarded
def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    changes, notices = params.parse_sets(a.set)
    if a.probe and not changes:
        raise UsageError("--probe needs the parameters to try: give --set KEY=VALUE")
    if not changes and a.redo == "none":
        raise UsageError("nothing to change: give --set KEY=VALUE and/or --redo")
    k = run_keys(a.run)
    r = connect(a.redis_url)
    info = runs.load(r, k)
    for notice in notices:
        print(f"genq: note: {notice}", file=sys.stderr)
    if "max_tokens" in changes or a.redo != "none":
        # Checked before anything changes, so a refused requeue undoes no result.
        limit = changes.get("max_tokens", params.current(r, k)[1].get("max_tokens"))
        params.check_fits(r, k, int(limit or params.DEFAULTS["max_tokens"]))
    if a.probe:
        return probe.main_probe(a, changes, r, k, info)
    if changes:
        version, diff = params.bump(r, k, changes, redo=a.redo, inflight=a.inflight)
        described = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in diff.items())
        print(f"run {a.run!r}: parameters version {version}: {described}")
        if a.inflight == "abort":
            print("requests running under older parameters are aborted and queued again")
    else:
        version = params.current(r, k)[0] + 1  # redo everything from the current version
    if a.redo != "none":
        results, failed = redo(r, k, info.total, a.redo, version)
        print(f"queued again: {results} finished results ({a.redo}), {failed} failed prompts")
    return 0


def redo(r: redis.Redis, k: RunKeys, total: int, mode: str, below: int) -> tuple[int, int]:
    """Walk each pass in bounded script calls; returns (results undone, failed revived)."""
    runner = ScriptRunner(r)
    counts = {"truncated": 0, "done": 0, "failed": 0}
    with Progress(transient=True, disable=not sys.stderr.isatty()) as bar:
        for what in REDO_PASSES[mode]:
            task = bar.add_task(f"redo {what}", total=total)
            pos = 0
            while pos < total:
                count, pos = runner(redo_call(k, what, pos, total, below, REDO_LIMIT))
                counts[what] += int(count)
                bar.update(task, completed=int(pos))
    return counts["truncated"] + counts["done"], counts["failed"]
