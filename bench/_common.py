"""What the bench scripts share beyond the tests' fixtures (a private redis-server, simulators,
the data set, the genq command line): consumers, timings, counters, moto's S3, a table, a parser."""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import orjson
import redis

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "tests"):  # genq's modules and the tests' fixtures, uninstalled
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
CLK_TCK = os.sysconf("SC_CLK_TCK")
# Fast simulators: 16-token answers as fast as they go, 64 slots (scale, status, conversations).
FAST_SIM = ["--time-scale", "10000", "--ttft", "0", "--length-dist", "fixed:16",
            "--max-running-requests", "64"]

from conftest import genq as _genq  # noqa: E402
from conftest import genq_env  # noqa: E402,F401 (the scripts import it from here)
from faultkit import private_redis  # noqa: E402,F401 (the scripts import it from here)
from pipeline import write_dataset  # noqa: E402,F401
from sim_fixtures import SimProcess, sim_flags  # noqa: E402,F401

from genq.common.net import free_port, wait_port  # noqa: E402
from genq.common.sglang.stream import parse_load  # noqa: E402


def genq(*args: str, redis_url: str, run: str, timeout: float = 1800, **kw):
    return _genq(*args, redis_url=redis_url, run=run, timeout=timeout, **kw)


def produce_once(redis_url: str, run: str, dataset: Path, *flags: str) -> None:
    genq("produce", str(dataset), "--once", *flags, redis_url=redis_url, run=run)


def consumer(redis_url: str, run: str, *args: str, log: Path | None = None,
             env: dict | None = None) -> subprocess.Popen:
    """A `genq consume *args` process on the run; its output to `log` (appended) or nowhere."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen([sys.executable, "-m", "genq", "consume", *args], cwd=REPO,
                                env={**genq_env(redis_url, run), **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT)
    finally:
        if log:
            out.close()


class _Help(argparse.RawDescriptionHelpFormatter):  # the docstring as written, defaults
    def _get_help_string(self, action: argparse.Action) -> str:
        unset = any(action.default is x for x in (None, False, argparse.SUPPRESS))
        return (action.help or "") + ("" if unset else " (default: %(default)s)")


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=_Help)
    p.add_argument("--json", help="also write every figure, raw, to this file")
    return p


@contextmanager
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="genq-bench-", ignore_cleanup_errors=True) as path:
        yield Path(path)


@contextmanager
def simulators(n: int, *flags: str) -> Iterator[list[SimProcess]]:
    sims = [SimProcess(*flags) for _ in range(n)]
    try:
        for sim in sims:
            sim.start(timeout=30)
        yield sims
    finally:
        for sim in sims:
            sim.cleanup()


def timed(args: list[str], env: dict | None, nofile: int | None = None, tree: Path = REPO,
          script: Path | None = None) -> dict:
    """A genq command (or a bench `script`, then with its stdout) to its end: wall s, CPU s
    (wait4), peak RSS MB, optionally under `ulimit -n`; `tree`: the checkout whose genq runs."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    start = time.monotonic()
    if tree != REPO:
        env = {**(env or os.environ), "PYTHONPATH": str(tree)}
    argv = [sys.executable, *([str(script)] if script else ["-m", "genq"]), *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=out, stderr=err,
                                preexec_fn=limit if nofile else None)
        _, status, ru = os.wait4(proc.pid, 0)
        out.seek(0), err.seek(0)
        if os.waitstatus_to_exitcode(status):
            raise SystemExit(f"{argv[1:4]} failed: {err.read().decode()[-2000:]}")
        return {"wall_s": round(time.monotonic() - start, 3), "cpu_s": ru.ru_utime + ru.ru_stime,
                "rss_mb": round(ru.ru_maxrss / 1024), **({"stdout": out.read()} if script else {})}


def latency(fetch) -> float:
    start = time.monotonic()
    fetch()
    return round(time.monotonic() - start, 3)


def proc_cpu_s(pid: int) -> float:
    """user+system CPU seconds of a live process so far (/proc/<pid>/stat, 1/CLK_TCK steps)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def reap(procs: list[subprocess.Popen], tick=None, period: float = 0.5) -> dict[int, tuple]:
    """Wait for every process, calling `tick()` between looks: {pid: (exit code, CPU s, when
    it exited)}, each by wait4 (poll() would reap it first and lose its CPU)."""
    got: dict[int, tuple] = {}
    while len(got) < len(procs):
        for proc in procs:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG) if proc.pid not in got else (0, 0, 0)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                got[pid] = (proc.returncode, ru.ru_utime + ru.ru_stime, time.monotonic())
        if tick:
            tick()
        time.sleep(period)
    return got


def synthetic_records(n: int) -> bytes:
    """n completions of ~2.3k tokens (about 9 kB of random words each), as shard lines."""
    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
             for _ in range(5000)]
    return b"".join(orjson.dumps({"index": i, "content": " ".join(rng.choices(words, k=1550)),
                                  "finish_reason": "stop"}) + b"\n" for i in range(n))


@contextmanager
def moto_s3(bucket: str, own_process: bool = False) -> Iterator[int]:
    """moto's S3 on a free port (in its own process: its CPU not ours), `bucket` made in it,
    AWS_* set for this process and what it starts; yields the port."""
    port = free_port()
    if own_process:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                 str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(port, timeout=30)
    else:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line a request otherwise
        server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    import boto3

    boto3.client("s3").create_bucket(Bucket=bucket)
    try:
        yield port
    finally:
        if own_process:
            proc.terminate()
            proc.wait(10)
        else:
            server.stop()


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / CLK_TCK, sum(fields) / CLK_TCK


def used_memory(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def redis_use(r: redis.Redis) -> tuple[float, int, int]:
    """Redis's CPU s, commands (but INFO; Lua's own count) and EVALSHAs so far."""
    cpu, stats = r.info("cpu"), r.info("commandstats")
    return (float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
            sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info"),
            stats.get("cmdstat_evalsha", {}).get("calls", 0))


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def table(rows: list[tuple], headers: tuple) -> str:
    cells = [tuple(str(c) for c in headers)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for n, row in enumerate(cells):
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if n == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def dump_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


class LoadSampler:
    """Each server's /v1/loads every `period` s from a thread: (t, running, waiting) each."""

    def __init__(self, urls: list[str], period: float = 0.1) -> None:
        self.urls, self.period = urls, period
        self.samples: list[list[tuple[float, int, int]]] = [[] for _ in urls]
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoadSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self.stop.is_set():
                for i, url in enumerate(self.urls):
                    try:  # SGLang 0.5's /v1/loads, as the simulator serves it by default
                        load = parse_load(client.get(url + "/v1/loads").json())
                    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                        continue
                    t = time.monotonic() - self.t0
                    self.samples[i].append((t, load["num_reqs"], load["num_waiting_reqs"]))
                self.stop.wait(self.period)


def slot_seconds(samples: list[tuple[float, int, int]], slots: int, t0: float, t1: float,
                 ) -> tuple[float, float]:
    """(idle slot-seconds, waiting request-seconds) between t0 and t1, a sample to the next."""
    idle = waiting = 0.0
    for (t, running, queued), (t_next, _, _) in zip(samples, samples[1:], strict=False):
        lo, hi = max(t, t0), min(t_next, t1)
        if hi > lo:
            idle += max(0, slots - running) * (hi - lo)
            waiting += queued * (hi - lo)
    return idle, waiting


def full_window(samples: list[tuple[float, int, int]], slots: int) -> tuple[float, float]:
    """From the first to the last moment the server was full: no start-up, no final drain."""
    full = [t for t, running, _ in samples if running >= slots]
    return (full[0], full[-1]) if len(full) > 1 else (0.0, 0.0)
