"""Start real simulator processes for tests: `SimProcess` and the `sim_factory` fixture."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from conftest import REPO, free_port


class SimProcess:
    """One `python -m genq.simulator` on a free port; `.url` once `/health` answers."""

    def __init__(self, *flags: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.flags = list(flags)
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self._log = Path(tempfile.mkstemp(prefix="genq-sim-", suffix=".log")[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> SimProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        with open(self._log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "genq.simulator", "--port", str(self.port), *self.flags],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait_healthy(timeout)
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"simulator exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=0.5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"simulator not healthy after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self._log.read_text(errors="replace")

    def stop(self) -> None:
        self._end(kill=False)

    def kill(self) -> None:
        self._end(kill=True)

    def _end(self, kill: bool) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.returncode = self.proc.returncode
        self.proc = None

    def cleanup(self) -> None:
        self.kill()
        self._log.unlink(missing_ok=True)


def sim_flags(**kwargs: object) -> list[str]:
    """`max_running_requests=8` → `--max-running-requests 8`; True gives a bare flag."""
    flags: list[str] = []
    for key, value in coarse_stream(kwargs).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not None and value is not False:
            flags += [flag, str(value)]
    return flags


def coarse_stream(kwargs: dict[str, object]) -> dict[str, object]:
    """Unless a test asks for its own --stream-interval: a chunk per 0.2 simulated seconds. At
    the time scales tests run at, a chunk per token would be more chunks than a Python
    simulator can send on time; the tests that check chunk shapes set the interval."""
    if "stream_interval" in kwargs:
        return kwargs
    tokens_per_s = float(str(kwargs.get("decode_tps", 87.5))) * float(
        str(kwargs.get("time_scale", 1)))
    return {**kwargs, "stream_interval": max(1, round(0.2 * tokens_per_s))}


@pytest.fixture
def sim_factory():
    """Start simulators with `sim_factory(time_scale=100, ...)`; all are stopped at teardown."""
    started: list[SimProcess] = []

    def start(**kwargs: object) -> SimProcess:
        sim = SimProcess(*sim_flags(**kwargs))
        started.append(sim)
        return sim.start()

    yield start
    for sim in started:
        sim.cleanup()
