"""The `genq` command: one console script dispatching to each service's own main."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from genq.common.cli import add_common, connect, guarded, run_keys

COMMANDS = {
    "sim": ("genq.simulator.cli", "main", "a simulated SGLang server"),
    "produce": ("genq.producer.cli", "main", "register a run and queue its prompts"),
    "consume": ("genq.consumer.cli", "main", "one consumer for one SGLang server"),
    "status": ("genq.monitor.status_cli", "status_main", "where the run stands"),
    "requeue": ("genq.producer.requeue", "main", "new parameters for a live run"),
    "export": ("genq.cli", "export_main", "one record per prompt, to a file"),
    "recover": ("genq.producer.recover", "main", "rebuild a run Redis lost, from its output"),
    "monitor": ("genq.monitor.cli", "main", "web page, /api/status, /metrics, progress.json"),
    "demo": ("genq.demo", "main", "the whole pipeline on one machine with the simulator"),
}

USAGE = "usage: genq COMMAND [ARGS]\n\ncommands:\n" + "".join(
    f"  {name:<9} {text}\n" for name, (_, _, text) in COMMANDS.items()
) + "\n`genq COMMAND --help` describes each one."


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] not in COMMANDS:
        print(f"genq: error: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[args[0]]
    return int(getattr(importlib.import_module(module), func)(args[1:]) or 0)


@guarded
def export_main(argv: list[str] | None = None) -> int:
    """Write the run's results, one record per done prompt index, newest version winning."""
    from genq.common.queue import run as runs
    from genq.common.queue.replies import text
    from genq.common.store import export_formats, s3

    p = argparse.ArgumentParser(prog="genq export", description=export_main.__doc__)
    p.add_argument("--out", required=True,
                   help="file to write, replaced atomically; its directory is made if missing; "
                        "an existing file this run's last export did not write is kept "
                        "beside it as NAME.earlier-TIME.EXT")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out without keeping it, whatever wrote it")
    p.add_argument("--shards", action="append", default=[], metavar="DIR",
                   help="shard directory to read (default: those the consumers registered)")
    p.add_argument("--include-failed", action="store_true",
                   help="also write one record per failed prompt with its reason")
    p.add_argument("--allow-ambiguous", action="store_true",
                   help="where two different lines carry the accepted key, keep the first read "
                        "(by default the export refuses and names them)")
    p.add_argument("--from-s3", metavar="URI",
                   help="read the shards from s3://bucket/prefix instead of local directories")
    p.add_argument("--format", choices=export_formats.FORMATS,
                   help="jsonl, parquet (typed columns, bounded row groups) or tokens (a "
                        "--token-ids run's {id, index, turn, input_ids, loss_mask, "
                        "finish_reason, is_tool_call, ended, stopped} rows for drafter "
                        "training; Parquet for an --out ending .parquet) or conversations (a "
                        "--turns all run's {id, conversations, tools, meta} rows, made turns "
                        "in place); default: parquet for an --out ending .parquet or .pq, "
                        "else jsonl")
    p.add_argument("--per-turn", action="store_true",
                   help="with --format conversations: one row per generation, its "
                        "conversation cut after it (train_only_last_turn)")
    add_common(p)
    a = p.parse_args(argv)
    fmt = export_formats.choose_format(a.out, a.format)  # before Redis: the flags' errors first
    if fmt == "tokens" and a.include_failed:
        p.error("--format tokens writes answers only: drop --include-failed")
    if a.per_turn and fmt != "conversations":
        p.error("--per-turn shapes --format conversations: add it, or drop --per-turn")
    if a.from_s3:
        s3.parse_uri(a.from_s3)
    k = run_keys(a.run)
    r = connect(a.redis_url)
    info = runs.load(r, k)
    dirs = [a.from_s3] if a.from_s3 else [d for d in a.shards or sorted(
        text(d) for d in r.smembers(k.outdirs)) if os.path.isdir(d)]
    result, kept = export_formats.run_export(r, k, info.total, dirs, a.out, from_s3=a.from_s3,
                                       fmt=fmt, overwrite=a.overwrite,
                                       include_failed=a.include_failed,
                                       allow_ambiguous=a.allow_ambiguous,
                                       per_turn=a.per_turn)
    failed = f" and {result.failed_written} failed" if a.include_failed else ""
    print(f"exported {result.written} records{failed} ({result.done} done of {info.total}) "
          f"from {result.shards} shards to {a.out}")
    if kept:
        print(f"{a.out} held another run's results (or a file not exported by this run): kept "
              f"as {kept}")
    if result.not_accepted_count:
        print(f"genq: warning: {result.not_accepted_count} records are not the accepted result "
              f"(its line is missing from the shards; the newest line was written instead; "
              f"first: {result.not_accepted[:5]})", file=sys.stderr)
    if result.answers_unkept:
        print(f"genq: warning: {result.answers_unkept} prompts failed on the schema have no "
              "answer in Redis (it keeps a bounded number) nor a failed line in the shards "
              f"read: their records lack `answer`; are all shard directories given?",
              file=sys.stderr)
    if result.missing:
        print(f"genq: warning: {result.done - result.written} done prompts have no record in "
              f"{dirs} (first: {result.missing[:5]}); are all shard directories given?",
              file=sys.stderr)
    return 1 if result.missing or result.not_accepted_count else 0
