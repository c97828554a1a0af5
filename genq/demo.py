"""`genq demo`: the whole pipeline on one machine: simulated SGLang servers, the producer,
one consumer per server, the monitor, a live progress bar, then the export."""

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

import redis
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from common.cli import DEFAULT_REDIS_URL
from common.net import free_port, wait_port

TOPICS = ["a parser", "a web server", "a sorting routine", "a CLI tool", "a cache", "a scheduler"]


def write_dataset(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            text = f"Write {TOPICS[i % len(TOPICS)]} in Python, variant {i}."
            f.write(json.dumps({"id": f"demo-{i}", "messages": [
                {"role": "user", "content": text}]}) + "\n")


def redis_url(procs: list[subprocess.Popen], workdir: Path) -> str:
    """REDIS_URL if it answers; otherwise a private redis-server for the demo."""
    url = os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        return url
    except redis.RedisError:
        pass
    if not shutil.which("redis-server"):
        raise SystemExit(f"genq demo: error: no Redis at {url} and no redis-server to start")
    port = free_port()
    procs.append(subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL))
    wait_port(port)
    return f"redis://127.0.0.1:{port}/0"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="genq demo", description=__doc__)
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--servers", type=int, default=2, help="simulated GPUs (default 2)")
    p.add_argument("--time-scale", type=float, default=150.0,
                   help="how much faster than a real H100 the simulator runs (default 150)")
    p.add_argument("--monitor-port", type=int, default=8000)
    p.add_argument("--out", default="demo-output.jsonl", help="where the export goes")
    a = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="genq-demo-"))
    procs: list[subprocess.Popen] = []
    try:
        return run_demo(a, workdir, procs)
    except TimeoutError as e:
        print(f"genq demo: error: a service did not come up: {e}", file=sys.stderr)
        return 1
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def run_demo(a: argparse.Namespace, workdir: Path, procs: list[subprocess.Popen]) -> int:
    url = redis_url(procs, workdir)
    run = f"demo-{int(time.time())}"
    env = dict(os.environ, REDIS_URL=url, GENQ_RUN=run)
    logs = open(workdir / "services.log", "ab")

    def spawn(*args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "genq", *args], env=env,
                                stdout=logs, stderr=logs)
        procs.append(proc)
        return proc

    data = workdir / "prompts.jsonl"
    write_dataset(data, a.prompts)
    servers = []
    for _ in range(a.servers):
        port = free_port()
        spawn("sim", "--port", str(port), "--time-scale", str(a.time_scale))
        servers.append(f"http://127.0.0.1:{port}")
    for server in servers:
        wait_port(int(server.rsplit(":", 1)[1]))
    subprocess.run([sys.executable, "-m", "genq", "produce", str(data), "--once"], env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=logs)
    consumers = [spawn("consume", "--server", s, "--burst", "--out", str(workdir / "out"))
                 for s in servers]
    spawn("monitor", "--port", str(a.monitor_port),
          "--progress-file", str(workdir / "progress.json"))
    print(f"run {run!r}: {a.prompts} prompts on {a.servers} simulated servers; "
          f"monitor at http://127.0.0.1:{a.monitor_port}/")
    watch(redis.Redis.from_url(url), run, a.prompts, consumers)
    exported = subprocess.run([sys.executable, "-m", "genq", "export", "--out", a.out],
                              env=env, capture_output=True, text=True)
    print(exported.stdout.strip() or exported.stderr.strip())
    status = subprocess.run([sys.executable, "-m", "genq", "status"], env=env,
                            capture_output=True, text=True)
    print(status.stdout)
    return exported.returncode


def watch(r: redis.Redis, run: str, total: int, consumers: list[subprocess.Popen]) -> None:
    from common.keys import RunKeys

    k = RunKeys(run)
    columns = [TextColumn("[bold]generating"), BarColumn(), TextColumn("{task.completed}/"
               "{task.total}"), TextColumn("{task.fields[rate]:.1f} req/s"),
               TimeRemainingColumn()]
    start = time.monotonic()
    with Progress(*columns) as bar:
        task = bar.add_task("run", total=total, rate=0.0)
        while any(c.poll() is None for c in consumers):
            done = int(r.bitcount(k.done)) + int(r.bitcount(k.failed))
            bar.update(task, completed=done, rate=done / max(time.monotonic() - start, 1e-6))
            time.sleep(0.5)
        bar.update(task, completed=int(r.bitcount(k.done)) + int(r.bitcount(k.failed)))
