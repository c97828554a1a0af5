"""The processes of a chaos soak: each can be killed, stopped, paused and started again on the
same port and directory, so the run sees a restart, not a new deployment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import httpx
from _common import REPO, genq_env
from pipeline import wait_for

from genq.common.net import free_port, wait_port


class Proc:
    """One restartable process; its output goes to one log file across restarts."""

    def __init__(self, name: str, args: list[str], log: Path, environ: dict[str, str],
                 marker: bytes = b"") -> None:
        self.name, self.args, self.log, self.env = name, args, log, environ
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.marker, self.offset, self.seen = marker, 0, False

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        self.seen = not self.marker
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.args, cwd=REPO, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT)
        self.starts += 1
        self.ready()

    def ready(self) -> None:
        """Wait until the process serves (nothing to wait for by default)."""

    @property
    def started(self) -> bool:
        """Up, and its log shows the marker since the last start (a SIGTERM before is moot)."""
        if self.up and not self.seen:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                self.seen = self.marker in f.read()
        return self.up and self.seen

    def wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.up and not self.started and time.monotonic() < deadline:
            time.sleep(0.1)

    def signal(self, sig: int) -> None:
        if self.up:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.up:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self, bound_s: float) -> tuple[int | None, float]:
        """SIGTERM: (exit status, seconds to exit), or (None, bound) and a SIGKILL if too slow."""
        if not self.up:
            return self.proc.returncode if self.proc else 0, 0.0
        self.signal(signal.SIGCONT)  # a paused process must be able to hear the SIGTERM
        start = time.monotonic()
        self.proc.terminate()
        try:
            rc = self.proc.wait(bound_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            return None, bound_s
        return rc, round(time.monotonic() - start, 2)


class Redis(Proc):
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        data = workdir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(data), "--save", "", "--appendonly", "yes",
                "--appendfsync", "everysec", "--maxmemory-policy", "noeviction"]
        super().__init__("redis", args, workdir / "redis.log", dict(os.environ))
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def ready(self) -> None:
        wait_port(self.port, timeout=30)


class Simulator(Proc):
    def __init__(self, n: int, workdir: Path, flags: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "genq.simulator", "--port", str(self.port), *flags]
        super().__init__(f"sim{n}", args, workdir / f"sim{n}.log", dict(os.environ))

    def ready(self) -> None:
        wait_for(self.healthy, timeout=30, what=f"{self.name} healthy")

    def healthy(self) -> bool:
        with suppress(httpx.TransportError):
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        return False

    def fault(self, body: dict) -> None:
        httpx.post(self.url + "/_sim/faults", json=body, timeout=5).raise_for_status()


def genq_proc(name: str, args: list[str], workdir: Path, redis_url: str, run: str,
              marker: bytes = b"") -> Proc:
    return Proc(name, [sys.executable, "-m", "genq", *args], workdir / f"{name}.log",
                genq_env(redis_url, run), marker)
