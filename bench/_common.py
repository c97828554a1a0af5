"""What every bench script shares: a private redis-server and simulator processes on free
ports, the genq command as a subprocess, Redis INFO deltas, and a small table printer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

REPO = Path(__file__).resolve().parent.parent
# The bench scripts import genq's own modules (keys, params) without needing an install.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
CLK_TCK = os.sysconf("SC_CLK_TCK")
from common.net import free_port, wait_port  # noqa: E402
from common.sglang.stream import parse_load  # noqa: E402


def env(redis_url: str | None = None, run: str | None = None) -> dict[str, str]:
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    if redis_url:
        e["REDIS_URL"] = redis_url
    if run:
        e["GENQ_RUN"] = run
    return e


class RedisServer:
    """A private redis-server (no persistence, noeviction) that is killed on exit."""

    def __init__(self, *extra: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="genq-bench-redis-"))
        self.port = free_port()
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--appendonly", "no",
                "--maxmemory-policy", "noeviction", *extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Simulator:
    """`python -m simulator` on a free port, ready once /health answers."""

    def __init__(self, *flags: str, port: int | None = None) -> None:
        self.port = port or free_port()  # a port of its own, or a restarted server's
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="genq-bench-sim-", suffix=".log")[1])
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "simulator", "--port", str(self.port), *flags],
                cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"simulator exited:\n{self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=0.5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.close()
        raise TimeoutError("simulator not healthy after 20 s")

    def cpu_s(self) -> float:
        return proc_cpu_s(self.proc.pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.unlink(missing_ok=True)

    def __enter__(self) -> Simulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def proc_cpu_s(pid: int) -> float:
    """user+system CPU seconds of a live process so far (/proc/<pid>/stat, 1/CLK_TCK steps)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def wait_rusage(proc: subprocess.Popen, timeout: float) -> tuple[int, float]:
    """Wait for a child and return (exit status, its user+system CPU seconds) via wait4."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, ru.ru_utime + ru.ru_stime
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{proc.args} did not exit within {timeout}s")
        time.sleep(0.005)


def genq(*args: str, redis_url: str, run: str, timeout: float = 600,
         check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "genq", *args], cwd=REPO,
                          env=env(redis_url, run), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"genq {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def redis_cpu_s(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def commandstats(r: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(v["calls"])
            for name, v in r.info("commandstats").items()}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    keys = set(after) | set(before)
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys
            if after.get(k, 0) - before.get(k, 0)}


def write_dataset(path: Path, n: int) -> Path:
    """n chat rows shaped like the tests' (`id`, one user message), written fast."""
    with open(path, "w") as f:
        for start in range(0, n, 10000):
            f.write("".join(
                f'{{"id": "p{i}", "messages": [{{"role": "user", "content": '
                f'"Write program number {i}."}}]}}\n'
                for i in range(start, min(n, start + 10000))))
    return path


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
    """Polls each server's /v1/loads every `period` seconds from a thread: (t, running,
    waiting) per server, t in seconds since start. The simulator counts exactly what a GPU
    would be doing, so these samples are the GPU-side view of a run."""

    def __init__(self, urls: list[str], period: float = 0.1) -> None:
        import threading
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
    """(idle slot-seconds, waiting request-seconds) between t0 and t1, each sample held until
    the next one."""
    idle = waiting = 0.0
    for (t, running, queued), (t_next, _, _) in zip(samples, samples[1:], strict=False):
        lo, hi = max(t, t0), min(t_next, t1)
        if hi > lo:
            idle += max(0, slots - running) * (hi - lo)
            waiting += queued * (hi - lo)
    return idle, waiting


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / CLK_TCK, sum(fields) / CLK_TCK
