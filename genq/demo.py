"""`genq demo`: the whole pipeline on one machine: simulated SGLang servers, the producer,
one consumer per server, the monitor, a live progress bar, then the export."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from genq.common.cli import connect, guarded
from genq.common.files import write_atomic
from genq.common.net import free_port, wait_port
from genq.common.queue.keys import RunKeys

# How long consumers get to exit once every prompt is settled (--burst exits within seconds).
SETTLE_WAIT_S = 30.0
PR_SET_PDEATHSIG = 1
TOPICS = ["a parser", "a web server", "a sorting routine", "a CLI tool", "a cache", "a scheduler"]


def dataset(n: int) -> bytes:
    """The demo's data set: n prompts, a JSON object a line."""
    rows = ({"id": f"demo-{i}", "messages": [
        {"role": "user", "content": f"Write {TOPICS[i % len(TOPICS)]} in Python, variant {i}."}]}
        for i in range(n))
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def die_with_parent() -> None:
    """Run in each child before exec: the kernel kills it when the demo dies, even by SIGKILL
    (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def redis_url(procs: list[subprocess.Popen], workdir: Path) -> tuple[str, bool]:
    """(URL, private?): REDIS_URL if set, else a private redis-server (AOF) in `workdir`."""
    url = os.environ.get("REDIS_URL")
    if url:
        connect(url).close()  # one clear line (a bad or unreachable URL) before anything starts
        return url, False
    if not shutil.which("redis-server"):
        raise SystemExit("genq demo: error: no redis-server binary to start a private Redis; "
                         "install it, or set REDIS_URL to a Redis the demo may write to")
    port = free_port()
    procs.append(subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
         "--appendonly", "yes", "--save", "", "--maxmemory-policy", "noeviction"],
        stdout=subprocess.DEVNULL, preexec_fn=die_with_parent))
    wait_port(port)
    return f"redis://127.0.0.1:{port}/0", True


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="genq demo", description=__doc__)
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--servers", type=int, default=2, help="simulated GPUs (default 2)")
    p.add_argument("--time-scale", type=float, default=150.0,
                   help="how much faster than a real H100 the simulator runs (default 150)")
    p.add_argument("--monitor-port", type=int, default=0,
                   help="port of the live monitor page (default: a free one)")
    p.add_argument("--out", help="where the export goes (default: a new genq-demo-* directory "
                                 "in the system temp dir, never the current directory)")
    p.add_argument("--write-dataset", metavar="PATH",
                   help="only write the demo's data set (--prompts rows) to PATH, unless it "
                        "exists, and exit (the compose stack's data set)")
    a = p.parse_args(argv)
    if a.prompts < 1 or a.servers < 1:
        p.error("--prompts and --servers must be >= 1")
    return a


@guarded
def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.write_dataset:
        path = Path(a.write_dataset)
        if path.exists():
            print(f"data set {path} exists; leaving it as it is")
        else:
            write_atomic(path, dataset(a.prompts))
            print(f"wrote {a.prompts} demo prompts to {path}")
        return 0
    if a.out is None:
        a.out = str(Path(tempfile.mkdtemp(prefix="genq-demo-out-")) / "results.jsonl")
    workdir = Path(tempfile.mkdtemp(prefix="genq-demo-"))
    procs: list[subprocess.Popen] = []
    try:
        return run_demo(a, workdir, procs)
    except TimeoutError as e:
        print(f"genq demo: error: a service did not come up: {e}", file=sys.stderr)
        return 1
    finally:
        for proc in reversed(procs):
            proc.terminate()  # a no-op for one that has exited
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def run_demo(a: argparse.Namespace, workdir: Path, procs: list[subprocess.Popen]) -> int:
    url, private = redis_url(procs, workdir)
    run = f"demo-{int(time.time())}"
    env = dict(os.environ, REDIS_URL=url, GENQ_RUN=run)
    logs = open(workdir / "services.log", "ab")

    def spawn(*args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "genq", *args], env=env,
                                stdout=logs, stderr=logs, preexec_fn=die_with_parent)
        procs.append(proc)
        return proc

    data = workdir / "prompts.jsonl"
    data.write_bytes(dataset(a.prompts))
    # A chunk per 0.2 simulated seconds: a chunk per token, at this speed, is more than a
    # simulator on a laptop can send on time.
    interval = max(1, round(0.2 * 87.5 * a.time_scale))
    ports = [free_port() for _ in range(a.servers)]
    for port in ports:
        spawn("sim", "--port", str(port), "--time-scale", str(a.time_scale),
              "--stream-interval", str(interval))
    for port in ports:
        wait_port(port)
    servers = [f"http://127.0.0.1:{port}" for port in ports]
    subprocess.run([sys.executable, "-m", "genq", "produce", str(data), "--once"], env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=logs)
    consumers = [spawn("consume", "--server", s, "--burst", "--out", str(workdir / "out"))
                 for s in servers]
    monitor_port = a.monitor_port or free_port()
    spawn("monitor", "--port", str(monitor_port), "--host", "127.0.0.1",
          "--progress-file", str(workdir / "progress.json"))
    where = "a private Redis (AOF, in a temp dir)" if private else url
    print(f"run {run!r}: {a.prompts} prompts on {a.servers} simulated servers, state in {where};"
          f" live monitor at http://127.0.0.1:{monitor_port}/ while the demo runs")
    watch(redis.Redis.from_url(url), run, a.prompts, consumers)
    exported = subprocess.run([sys.executable, "-m", "genq", "export", "--out", a.out],
                              env=env, capture_output=True, text=True)
    print(exported.stdout.strip() or exported.stderr.strip())
    if private:
        # The full status table ends in advice (`genq requeue ...`) that needs this Redis,
        # which is about to go; say what happened in figures only.
        print(summary(env))
    else:
        print(subprocess.run([sys.executable, "-m", "genq", "status"], env=env,
                             capture_output=True, text=True).stdout)
    if exported.returncode == 0:
        print(closing_advice(a.out, run, url, private))
    return exported.returncode


def summary(env: dict[str, str]) -> str:
    st = json.loads(subprocess.run([sys.executable, "-m", "genq", "status", "--json"], env=env,
                                   capture_output=True, text=True, check=True).stdout)
    finish = ", ".join(f"{k} {v}" for k, v in st["finish_reasons"].items())
    tokens = st["output_tokens"]
    return (f"{st['done']} of {st['total']} prompts done, {st['failed']} failed; "
            f"finish reasons: {finish}; {st['truncation_rate']:.0%} hit max_tokens\n"
            f"output tokens: mean {tokens['mean']:.0f}, p50 {tokens['p50']}, "
            f"p90 {tokens['p90']}, max {tokens['max']}\n")


def closing_advice(out: str, run: str, url: str, private: bool) -> str:
    """Commands that still work once the demo's services (and private Redis) are gone."""
    q = shlex.quote
    lines = ["next:", f"  $ head -n 2 {q(out)}", "  $ genq demo --help"]
    if not private:
        lines.insert(2, f"  $ REDIS_URL={q(url)} genq status --run {q(run)}")
    return "\n".join(lines)


def watch(r: redis.Redis, run: str, total: int, consumers: list[subprocess.Popen]) -> None:
    k = RunKeys(run)

    def settled() -> int:
        return int(r.bitcount(k.done)) + int(r.bitcount(k.failed))

    columns = [TextColumn("[bold]generating"), BarColumn(), TextColumn("{task.completed}/"
               "{task.total}"), TextColumn("{task.fields[rate]:.1f} req/s"),
               TimeRemainingColumn()]
    start = time.monotonic()
    with Progress(*columns) as bar:
        task = bar.add_task("run", total=total, rate=0.0)
        settled_at = None
        while any(c.poll() is None for c in consumers):
            done = settled()
            bar.update(task, completed=done, rate=done / max(time.monotonic() - start, 1e-6))
            # Every prompt is settled; a consumer that has not exited SETTLE_WAIT_S later is
            # stuck, and waiting on it would keep the demo (and what it started) alive.
            settled_at = settled_at or (time.monotonic() if done >= total else None)
            if settled_at and time.monotonic() - settled_at > SETTLE_WAIT_S:
                break
            time.sleep(0.5)
        bar.update(task, completed=settled())
