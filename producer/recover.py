"""`genq recover --shards DIR…`: rebuild a run Redis lost from its manifest and shards; safe to
repeat, and the run reappears in one MULTI, its identity last."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from typing import Any

import redis

from genq.common.cli import add_common, connect, guarded, run_keys
from genq.common.data import manifest as manifests
from genq.common.data import recovery
from genq.common.data import recovery_turns as conversations
from genq.common.data.records import parse_line
from genq.common.errors import GenqError, UsageError
from genq.common.queue.keys import RunKeys
from genq.common.queue.replies import text
from genq.common.queue.run import ALL
from genq.common.report.runhealth import recover_command
from genq.common.sglang import continuation
from genq.common.store.export import shard_paths
from genq.common.task import task_of


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="genq recover", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", action="extend", default=[], metavar="DIR", nargs="+",
                   help="output directories of the run's consumers (their --out); repeatable")
    p.add_argument("--from-s3", metavar="URI",
                   help="read the manifest and shards from S3 instead of (or as well as) DIRs")
    p.add_argument("--partial", action="store_true",
                   help="recover although output directories the manifests list are not given "
                        "(their results run again, and exporting them later may be refused)")
    p.add_argument("--replace", action="store_true",
                   help="the run's name is taken in Redis by a different (re-created) run: "
                        "delete that one's state and recover this one in its place")
    add_common(p)
    a = p.parse_args(argv)
    if not a.shards and not a.from_s3:
        p.error("give the run's output directories with --shards DIR (or --from-s3 URI)")
    return a


def local_manifests(dirs: list[str], run: str) -> list[dict[str, Any]]:
    found = []
    for directory in dirs:
        if not os.path.isdir(directory):
            raise UsageError(f"--shards {directory}: not a directory")
        found.append(manifests.find(directory, run))
    return [m for m in found if m is not None]


def local_streams(dirs: list[str], run: str) -> Iterator[Iterable[bytes]]:
    for path in shard_paths(dirs, run):
        with suppress(FileNotFoundError), open(path, "rb") as f:
            yield f


def pending(lines: Iterable[bytes], wanted: dict[int, tuple[int, int, int]],
            samples: int = 1) -> Iterator[dict]:
    """The continuable records among these shard lines that are the wanted result, task ->
    (params_version, attempt, gen), of their task: the partials a recover keeps."""
    for line in lines:
        rec = parse_line(line)
        if rec is not None and continuation.continuable(rec) \
                and (task := task_of(rec, samples)) is not None and wanted.get(task) == (
                    rec.get("params_version"), rec.get("attempt"), int(rec.get("gen") or 0)):
            yield rec


def present(r: redis.Redis, k: RunKeys, epoch: str) -> str | None:
    """Why the run must not be rebuilt now (present, or another run holds the name); None when it
    is gone."""
    meta = {text(key): text(v) for key, v in r.hgetall(k.meta).items()}
    if "total" not in meta:
        return None
    if meta.get("epoch") == epoch:
        return "present"
    return (f"run {k.run!r} in Redis is a different run (epoch {meta.get('epoch')}, the "
            f"output is of epoch {epoch}): it was registered again after the loss. Recovering "
            "here would mix two runs; pass --replace to delete that one and recover this one")


def recover(r: redis.Redis, k: RunKeys, manifest: dict[str, Any],
            streams: Callable[[], Iterable[Iterable[bytes]]], out_dirs: list[str], *,
            replace: bool = False) -> tuple[bool, str]:
    """Rebuild the run from a manifest and its shard line streams (opened anew by each call of
    `streams`: once for the results, once more for the partials pending continuations need);
    (whether this call did, one line saying what happened)."""
    if manifest["run"] != k.run:
        raise UsageError(f"the manifest is of run {manifest['run']!r}, not {k.run!r}")
    state = present(r, k, manifest["epoch"])
    if state == "present":
        return False, f"run {k.run!r} is in Redis already: nothing to recover"
    if state is not None and not replace:
        raise GenqError(state)
    # A --turns all run: a chain of generations a task, not one result (recovery_turns.py).
    rebuilt = conversations.rebuild(manifest, streams) if manifest.get("turns") == ALL else None
    rec = rebuilt.rec if rebuilt else recovery.rebuild(manifest, streams())
    # Partials and conversations go first, in batches, and the run's state after them in one
    # MULTI: a consumer that sees the run back finds them. A replaced run's go with them.
    conversations.put(r, k, rebuilt)
    # A conversation's pending continuation is its cut last turn, the one line of its claim
    # (version, attempt, gen) that ended at max_tokens: found as a one-turn run's answer is.
    wanted = recovery.pending_continuations(manifest, rec)
    if wanted:
        lines = (line for stream in streams() for line in stream)
        samples = int(manifest.get("samples") or 1)
        continuation.put(r, k, pending(lines, wanted, samples), int(manifest["continues"]),
                         samples)
    else:
        continuation.drop_all(r, k)
    with r.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(k.meta)  # two recovers at once: the second sees the first's meta
            if present(pipe, k, manifest["epoch"]) == "present":
                return False, f"run {k.run!r} was recovered meanwhile: nothing to do"
            pipe.multi()
            if replace:
                pipe.delete(k.meta)
            recovery.restore(pipe, k, manifest, rec, out_dirs)
            pipe.execute()
        except redis.WatchError:
            return False, f"run {k.run!r} changed while recovering; run genq recover again"
    message = (f"recovered run {k.run!r}: {len(rec.standing)} of {manifest['total']} done, "
               f"{len(rec.kept)} results kept aside by a redo, parameters "
               f"v{manifest['params_version']}, from {rec.lines} shard lines"
               + (f" ({rec.skipped} unreadable skipped)" if rec.skipped else ""))
    return True, message


@guarded
def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    k = run_keys(a.run)
    dirs = [os.path.abspath(d) for d in a.shards]
    found = local_manifests(dirs, k.run)
    if a.from_s3:  # shipped output (docs/DEPLOY.md): every consumer's manifest, the shards
        from genq.common.store import s3 as store

        found += store.run_source(a.from_s3, k.run, manifests.parse)[0]

    def streams() -> Iterator[Iterable[bytes]]:
        yield from local_streams(dirs, k.run)
        if a.from_s3:  # the shards alone: the manifests were read above
            shipped = store.iter_shards(store.client(), store.parse_uri(a.from_s3), k.run)
            yield from (stream for _, _, stream in shipped)
    if not found:
        raise UsageError(f"no run manifest ({k.run}.manifest.json) in {', '.join(dirs)}: "
                         "are these the run's output directories, and is --run right?")
    manifest = manifests.newest(found)
    listed = sorted({d for m in found for d in m.get("out_dirs", ())})
    missing = [d for d in listed if d not in dirs]
    if missing and not a.partial and not a.from_s3:
        every = recover_command(k.run, sorted({*listed, *dirs}))
        raise UsageError(f"the run's manifests list output directories not given: "
                         f"{', '.join(missing)}; their results would run again. Give them all: "
                         f"{every} (or --partial to go on without them)")
    r = connect(a.redis_url)
    started = time.monotonic()
    recovered, message = recover(r, k, manifest, streams, sorted({*dirs, *listed}),
                                 replace=a.replace)
    print(f"{message} in {time.monotonic() - started:.1f} s")
    if recovered:
        print("waiting consumers resume by themselves; start a producer (`genq produce "
              f"{manifest['dataset']}`) if none is running", file=sys.stderr)
    return 0
