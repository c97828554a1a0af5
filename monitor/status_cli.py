"""`genq status`: where the run stands, as JSON, a table, or a live view that refreshes."""

from __future__ import annotations

import argparse
import sys
import time

import orjson
import redis

from genq.common.cli import add_common, connect, guarded
from genq.common.report.status import read_status
from genq.common.report.status_table import render_table

WATCH_INTERVAL_S = 2.0


def _view(status: dict):
    """The live view: a progress bar over the status table."""
    from rich.console import Group
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn

    bar = Progress("[bold]done", BarColumn(bar_width=None), MofNCompleteColumn(),
                   TaskProgressColumn(), expand=True)
    bar.add_task("done", total=status["total"] or None, completed=status["done"])
    return Group(bar, render_table(status))


def _watch(client: redis.Redis, run: str) -> int:
    from rich.live import Live

    with Live(_view(read_status(client, run)), auto_refresh=False) as live:
        try:
            while True:
                time.sleep(WATCH_INTERVAL_S)
                live.update(_view(read_status(client, run)), refresh=True)
        except KeyboardInterrupt:
            return 0


@guarded
def status_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="genq status", description="Where the run stands.")
    add_common(p)
    p.add_argument("--json", action="store_true", help="print the status JSON (CLI.md)")
    p.add_argument("--watch", action="store_true",
                   help=f"refresh every {WATCH_INTERVAL_S:g} s until Ctrl-C")
    args = p.parse_args(argv)
    client = connect(args.redis_url, socket_timeout=10)
    try:
        if args.watch:
            return _watch(client, args.run)
        status = read_status(client, args.run)
        if args.json:
            sys.stdout.buffer.write(orjson.dumps(status) + b"\n")
            sys.stdout.flush()
        else:
            from rich.console import Console

            Console().print(render_table(status))
        return 0
    finally:
        client.close()
