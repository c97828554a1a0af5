"""`genq requeue`: new parameters for a live run, and optionally finished prompts run again
under them, without restarting anything or losing finished work."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import redis
from rich.progress import Progress

from genq.common import params, schema
from genq.common.cli import add_common, connect, guarded, run_keys
from genq.common.data import manifest as manifests
from genq.common.errors import UsageError
from genq.common.queue import bitmap
from genq.common.queue import run as runs
from genq.common.queue.keys import RunKeys
from genq.common.queue.replies import blob, text
from genq.common.queue.scripts import ScriptRunner, redo_call
from genq.common.report.status import read_status
from genq.common.report.status_table import human_duration
from genq.common.sglang import continuation
from genq.common.store import export
from genq.common.store import export_turns as conversations
from genq.common.store import s3 as store
from genq.common.task import task_of
from genq.producer import probe, rewind


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="genq requeue", description=__doc__)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"parameter to change ({', '.join(sorted(params.KNOWN))}); repeatable")
    p.add_argument("--raw", action="append", default=[], metavar="KEY=VALUE",
                   help="a server-specific parameter genq does not know, sent as-is (value "
                        "parsed as JSON where it parses); repeatable")
    p.add_argument("--schema", metavar="FILE", help="a JSON Schema answers must match from the "
                   "new version on (its response_format; --unset response_format drops it)")
    p.add_argument("--unset", action="append", default=[], metavar="KEY",
                   help="remove a parameter (a known one falls back to its default)")
    p.add_argument("--redo", choices=["none", "truncated", "failed", "all", "missing"],
                   default="none", help="also run again: results that hit max_tokens, failed "
                   "prompts, all, or the done results S3 does not hold (missing, with --from-s3)")
    p.add_argument("--inflight", choices=["abort", "finish"],
                   help="requests running under older parameters: abort and requeue them "
                        "(default when parameters change) or let them finish (default for "
                        "a --redo alone)")
    p.add_argument("--continue", dest="cont", action="store_true",
                   help="with --redo truncated: continue each truncated answer from where it "
                        "stopped instead of generating it again (reads the shards as genq "
                        "export does)")
    p.add_argument("--shards", action="append", default=[], metavar="DIR",
                   help="with --continue: shard directory to read (default: those the "
                        "consumers registered); with --redo missing: an output to check")
    p.add_argument("--from-s3", metavar="URI",
                   help="with --continue: read the shards from s3://bucket/prefix instead; with "
                        "--redo missing: the shipped output to check")
    p.add_argument("--dry-run", action="store_true",
                   help="say what would change and what it costs, change nothing")
    p.add_argument("--probe", type=_positive, metavar="N",
                   help="change nothing: run N of the prompts the redo would run (default: "
                        "the truncated) under --set, report truncation, lengths, cost and "
                        "ETA (docs/REFERENCE.md)")
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
    changes = params.parse_sets(a.set, a.raw)
    params.check_changeable(changes, a.unset)
    if a.schema:
        changes["response_format"] = schema.response_format(a.schema)
    if a.probe and not changes:
        raise UsageError("--probe needs the parameters to try: give --set KEY=VALUE")
    if not changes and not a.unset and a.redo == "none":
        raise UsageError("nothing to change: give --set/--raw/--unset KEY and/or --redo")
    if a.cont and a.redo != "truncated":
        raise UsageError("--continue continues truncated answers: give --redo truncated")
    if a.redo == "missing" and (not (a.from_s3 or a.shards) or a.probe):
        raise UsageError("--redo missing runs again what the outputs lack: give --from-s3 URI "
                         "and/or --shards DIR..., and no --probe")
    if a.from_s3 and not a.cont and a.redo != "missing":
        raise UsageError("--from-s3 reads the partials of --continue or what --redo missing "
                         "checks: give one of them")
    k = run_keys(a.run)
    r = connect(a.redis_url)
    info = runs.load(r, k)
    if info.turns == runs.ALL and (a.schema or a.cont and a.probe):
        flag = "--schema" if a.schema else "--probe with --continue"
        raise UsageError(f"{flag} is not built for a --turns all run")
    inflight = a.inflight or ("abort" if changes or a.unset else "finish")
    plan_with = functools.partial(make_plan, r, k, changes=changes, unset=a.unset, redo=a.redo,
                                  inflight=inflight)
    plan = plan_with()
    if not plan.diff and a.redo == "none":
        raise UsageError("nothing to change: the parameters already have these values")
    # Refused before any version is made, so a refused requeue undoes no result.
    max_tokens = plan.new_params.get("max_tokens") or params.DEFAULTS["max_tokens"]
    params.check_fits(r, k, int(max_tokens))
    with tempfile.TemporaryDirectory(prefix="genq-s3-") as fetched:
        shards = a.shards
        if a.cont and a.from_s3:  # the shards from S3 alone, read as the partials are kept
            store.fetch_run(store.parse_uri(a.from_s3), k.run, fetched)
            shards = [fetched]
        rewinds = None
        if a.redo == "missing":  # the done results none of the outputs holds
            outputs = [*a.shards]
            if a.from_s3:
                store.fetch_run(store.parse_uri(a.from_s3), k.run, fetched)
                outputs.append(fetched)
            if info.turns == runs.ALL:  # conversations: from their earliest turn missing
                rewinds = rewind.find(r, k, outputs, info.samples)
                missing = tuple(sorted(rewinds.turn))
            else:
                missing = tuple(export.not_held(r, k, info.total, outputs))
            plan = plan_with(missing=missing)
        return apply(a, r, k, info, changes, inflight, plan_with, plan, shards, rewinds)


def apply(a: argparse.Namespace, r: redis.Redis, k: RunKeys, info: runs.RunInfo,
          changes: dict[str, Any], inflight: str, plan_with: Callable[..., Plan], plan: Plan,
          shards: list[str], rewinds: rewind.Rewinds | None = None) -> int:
    """The requeue itself, once its flags and the plan are checked: probe, dry run, or keep the
    partials, switch the version and redo."""
    found = find_partials(r, k, info, shards) if a.cont else None
    if a.probe:
        report = probe.run_probe(r, k, info, n=a.probe, changes=changes, mode=a.redo,
                                 concurrency=a.probe_concurrency,
                                 partials={t: p for p in found[0]
                                           if (t := task_of(p, info.samples)) is not None}
                                 if found else None)
        print(orjson.dumps(report).decode() if a.json else probe.describe(report))
        return 0
    if found:  # read once, and kept as read unless this is a dry run
        plan = plan_with(partials=keep_partials(r, k, found, plan.new_version, a.dry_run,
                                                        info.samples))
    lines = render(plan) if rewinds is None else [*render(plan)[:1], rewinds.describe(),
                                                     *render(plan)[2:]]
    if a.dry_run:
        print("\n".join(["dry run, nothing changed:", *lines]))
        return 0
    if not found:  # partials are for the version their requeue made only
        continuation.drop_all(r, k)
    # A redo always makes a version, even without parameter changes: its scope is "results
    # of versions before this one", which must not include what runs after it.
    version, _ = params.bump(r, k, changes, redo=a.redo, inflight=inflight, unset=a.unset)
    if version != plan.new_version:  # another requeue made one meanwhile: not theirs either
        continuation.drop_all(r, k)
    if rewinds is not None:  # back to their kept turns first; redo.lua undoes the done ones
        rewind.apply(r, k, rewinds)
    results, failed = (redo(r, k, info.total, a.redo, version, plan.missing)
                       if a.redo != "none" else (0, 0))
    # The manifest beside the shards must know this version before Redis could lose it.
    manifests.upkeep(r, k, sorted(text(d) for d in r.smembers(k.outdirs)), info.epoch)
    if a.from_s3 and (manifest := manifests.snapshot(r, k)):  # where the disks may be gone
        store.put_manifest(a.from_s3, k.run, manifest)
    print("\n".join(lines))
    if a.redo != "none":
        print(f"queued again: {results} finished results ({a.redo}), {failed} failed prompts")
    return 0


def keep_partials(r: redis.Redis, k: RunKeys, found: tuple[Iterator[dict], int, list[str]],
                  version: int, dry_run: bool, samples: int) -> tuple[int, int, int, list[str]]:
    """Keep these partials for `version` (in place of any older), before it exists so that
    every claim of it finds them, or only count them; (kept, their tokens, truncated results
    not continued, the directories read)."""
    records, truncated, dirs = found
    if dry_run:
        kept = tokens = 0
        for rec in records:
            kept, tokens = kept + 1, tokens + int(rec["completion_tokens"])
    else:
        kept, tokens, size = continuation.keep(r, k, records, version, samples)
        print(f"partials kept for --continue: {kept} ({size:,} bytes of Redis, zstd)")
    return kept, tokens, truncated - kept, dirs


def find_partials(r: redis.Redis, k: RunKeys, info: runs.RunInfo,
                  shards: list[str]) -> tuple[Iterator[dict], int, list[str]]:
    """The continuable standing truncated results (of a conversation: its cut turn), read as
    they are taken; how many truncated results there are; the directories read."""
    dirs = [d for d in shards or sorted(text(d) for d in r.smembers(k.outdirs))
            if os.path.isdir(d)]
    truncated = blob(r.get(k.truncated))
    records = conversations.truncated(r, k, dirs) if info.turns == runs.ALL else \
        export.standing(r, k, info.total, dirs, lambda i: bitmap.is_set(truncated, i))
    usable = (rec for rec in records if continuation.continuable(rec))
    return usable, sum(1 for _ in bitmap.set_indices(truncated, below=info.total)), dirs


def redo(r: redis.Redis, k: RunKeys, total: int, mode: str, below: int,
         missing: tuple[int, ...] = ()) -> tuple[int, int]:
    """Walk each pass in bounded script calls; returns (results undone, failed revived)."""
    runner = ScriptRunner(r)
    counts = dict.fromkeys(("truncated", "done", "failed", "missing"), 0)
    if mode == "missing":  # the one pass whose indices come from here, not a run bitmap
        r.set(k.redo_missing, bitmap.encode(missing, total))
    with Progress(transient=True, disable=not sys.stderr.isatty()) as bar:
        for what in params.REDO_PASSES.get(mode, (mode,)):
            task = bar.add_task(f"redo {what}", total=total)
            pos = 0
            while pos < total:
                count, pos = runner(redo_call(k, what, pos, total, below))
                counts[what] += int(count)
                bar.update(task, completed=int(pos))
    r.delete(k.redo_missing)
    return counts["truncated"] + counts["done"] + counts["missing"], counts["failed"]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a requeue will do: --dry-run prints it; every requeue prints it after acting."""
    run: str
    version: int  # the current version
    new_version: int
    diff: dict[str, list[Any]]
    new_params: dict[str, Any]
    redo: str
    inflight: str
    results: int  # finished results the redo sets aside and runs again
    failed: int  # failed prompts the redo makes runnable again
    aborted: int  # requests in flight that are aborted and queued again
    tokens: tuple[int, int]  # extra output tokens, low and high estimate
    tok_per_s: float
    continued: tuple[int, int, int] | None = None  # --continue: answers, tokens kept, regenerated
    dirs: tuple[str, ...] = ()  # the shard directories --continue read
    missing: tuple[int, ...] = ()  # --redo missing: the done tasks S3 holds no result for


def extra_tokens(*, redo: str, results: int, failed: int, aborted: int, mean: float,
                 ctok_sum: int, old_max: int, new_max: int, continued: int = 0) -> tuple[int, int]:
    """(low, high) output tokens the requeue adds: a truncated result between its old and new
    max_tokens (continued: their difference), `all` about what it has, others a mean result."""
    again = results if redo == "missing" else 0  # a mean result each
    low = high = round((failed + aborted + again) * mean)
    if redo == "truncated":
        high += continued * max(0, new_max - old_max)
        results -= continued
        low += results * old_max
        high += results * max(old_max, new_max)
    elif redo == "all":
        low += ctok_sum
        high += round(ctok_sum * max(1.0, new_max / old_max)) if old_max else ctok_sum
    return low, high


def make_plan(r: redis.Redis, k: RunKeys, *, changes: dict[str, Any], unset: list[str],
              redo: str, inflight: str,
              partials: tuple[int, int, int, list[str]] | None = None,
              missing: tuple[int, ...] = ()) -> Plan:
    version, old = params.current(r, k)
    new, diff = params.apply(old, changes, unset)
    st = read_status(r, k.run)
    results = {"truncated": st["truncated"], "all": st["done"],
               "missing": len(missing)}.get(redo, 0)
    failed = st["failed"] if redo in ("failed", "all") else 0
    aborted = st["inflight"] if inflight == "abort" else 0
    old_max = int(old.get("max_tokens", params.DEFAULTS["max_tokens"]))
    new_max = int(new.get("max_tokens", params.DEFAULTS["max_tokens"]))
    tokens = extra_tokens(redo=redo, results=results, failed=failed, aborted=aborted,
                          mean=st["output_tokens"]["mean"] or 0.0,
                          ctok_sum=st["output_tokens_total"], old_max=old_max, new_max=new_max,
                          continued=partials[0] if partials else 0)
    continued = partials[:3] if partials else None
    return Plan(run=k.run, version=version, new_version=version + 1, diff=diff,
                new_params=new, redo=redo, inflight=inflight, results=results, failed=failed,
                aborted=aborted, tokens=tokens, tok_per_s=st["rate"]["tok_per_s"],
                continued=continued, dirs=tuple(partials[3]) if partials else (),
                missing=missing)


def _tokens(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k" if n >= 1e4 else str(n)


def _span(low: float, high: float, fmt) -> str:
    return fmt(low) if fmt(low) == fmt(high) else f"{fmt(low)}–{fmt(high)}"


def render(plan: Plan) -> list[str]:
    """The summary, one fact a line."""
    what = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in plan.diff.items())
    lines = [f"run {plan.run!r}: parameters version {plan.new_version}: "
             f"{what or 'no parameter changes'}"]
    if plan.redo in ("truncated", "all"):
        scope = "that ended truncated" if plan.redo == "truncated" else "all"
        lines.append(f"redo {plan.redo}: {plan.results} finished results ({scope}) of older "
                     "versions run again, and any still in flight that end in scope")
    if plan.redo == "missing":
        first = ", ".join(map(str, plan.missing[:10])) + (", ..." if plan.results > 10 else "")
        lines.append(f"redo missing: {plan.results} finished results S3 does not hold run "
                     f"again{f' (tasks {first})' if first else ''}")
    if plan.continued:
        n, kept, again = plan.continued
        lines.append(f"continue: {n} truncated answers continue from their partial ({kept:,} "
                     f"tokens not decoded again); {again} are generated again (partial not "
                     f"found in {', '.join(plan.dirs) or 'any shard directory'}, or not "
                     "continuable)")
    if plan.redo in ("failed", "all"):
        lines.append(f"redo failed: {plan.failed} failed prompts run again")
    if plan.inflight == "abort":
        lines.append(f"in flight: {plan.aborted} requests under older parameters are aborted "
                     "and queued again")
    else:
        lines.append("in flight: requests under older parameters finish and are kept")
    low, high = plan.tokens
    cost = f"cost: about {_span(low, high, _tokens)} extra output tokens"
    if plan.tok_per_s > 0:
        cost += (f", {_span(low / plan.tok_per_s, high / plan.tok_per_s, human_duration)} "
                 f"at the current {plan.tok_per_s:,.0f} tok/s")
    else:
        cost += " (no current rate to turn into time)"
    return [*lines, cost]
