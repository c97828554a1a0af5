"""Shared fixtures: a private redis-server per test session (per xdist worker), fresh run names,
free ports."""

from __future__ import annotations

import itertools
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import redis

from genq.common import net
from genq.common.net import wait_port  # noqa: F401 (tests import it from here)
from genq.common.queue import scripts

REPO = Path(__file__).resolve().parent.parent

pytest_plugins = ["sim_fixtures"]

# Under xdist each worker takes the ports of its servers (Redis, simulators, moto) from its own
# block below the kernel's ephemeral range (32768 and up on Linux): a port one worker found free
# cannot be taken by another worker, nor handed to a client connection as its local port, in the
# moment before the server binds it. Blocks start at 20000, 400 ports each.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_BLOCK = 400
_PORTS = (itertools.cycle(range(20000 + int(_WORKER[2:]) * _BLOCK,
                                20000 + (int(_WORKER[2:]) + 1) * _BLOCK))
          if _WORKER.startswith("gw") and int(_WORKER[2:]) < 30 else None)
if _PORTS is not None:  # another session on the machine starts its workers elsewhere in the block
    for _ in range(random.randrange(_BLOCK)):
        next(_PORTS)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: two workers a core. A test spends most of its wall waiting on the processes it
    drives (consumers, simulators, Redis), so one worker a core leaves the cores half idle
    (measured on 2 cores: 265 s with 4 workers against 391 s with 2). `-n logical` keeps one a
    core, for the slow tier's fault windows (.ci/run)."""
    if config.option.numprocesses == "logical":
        return None  # xdist's own: one worker a (logical) core
    return 2 * (os.cpu_count() or 1)


def free_port() -> int:
    """A local port nothing listens on, for a server a test is about to start."""
    if _PORTS is None:
        return net.free_port()
    for _ in range(_BLOCK):
        port = next(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in worker {_WORKER}'s block")


class RedisServer:
    """A private redis-server that a test may kill, restart and reconfigure."""

    def __init__(self, directory: Path, port: int | None = None, *extra: str) -> None:
        self.dir = directory
        self.port = port or free_port()
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.dir), "--save", "", "--appendonly", "no",
            "--maxmemory-policy", "noeviction", *self.extra,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        self.proc.wait(timeout=10)
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


@pytest.fixture(scope="session", autouse=True)
def producer_marks():
    """The run marks producers leave (producer/marks.py) in a directory of this session's, not
    the user's ~/.local/state."""
    directory = tempfile.mkdtemp(prefix="genq-state-")
    os.environ["XDG_STATE_HOME"] = directory
    yield
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def shared_real_servers():
    """The real tier's shared SGLang servers (tests/sglang_servers.py), stopped at the end."""
    yield
    if "sglang_servers" in sys.modules:
        sys.modules["sglang_servers"].stop_shared()


@pytest.fixture(scope="session")
def redis_server():
    directory = Path(tempfile.mkdtemp(prefix="genq-redis-"))
    # The shared Redis persists like a production one should (the no-persistence alert is
    # tested on private servers); fault tests start their own without AOF.
    server = RedisServer(directory, None, "--appendonly", "yes")
    server.start()
    yield server
    server.stop(kill=True)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def r(redis_server):
    client = redis_server.client()
    yield client
    client.close()


@pytest.fixture
def run_name() -> str:
    """A fresh run per test instead of FLUSHALL, so tests never see each other's keys."""
    return "t" + uuid.uuid4().hex[:10]


def genq_env(redis_url: str, run: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(REDIS_URL=redis_url, GENQ_RUN=run, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def genq(*args: str, redis_url: str, run: str, check: bool = True, timeout: float = 60,
         **kw) -> subprocess.CompletedProcess:
    """Run the real `genq` command line as a user would."""
    proc = subprocess.run(
        [sys.executable, "-m", "genq", *args], env=genq_env(redis_url, run),
        capture_output=True, text=True, timeout=timeout, **kw,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"genq {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def ack_call(k, job_id: str, index: int, exec_id: str, *, server: str, **result) -> scripts.Call:
    """The ack of one result (the consumer acks in batches: scripts.ack_many_call); the script
    answers a list of one code."""
    return scripts.ack_many_call(k, server, [scripts.Result(job_id=job_id, index=index,
                                                            exec_id=exec_id, **result)])


# The real-server tiers start real SGLang servers (minutes on a CPU) and a real Slurm inside
# their tests' setup: each of their tests gets this, set here once for the tier, where every
# other test has the 120 s of pyproject (at most 300 s where a test says so).
REAL_TIER_TIMEOUT_S = 900


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("real_sglang") or item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.timeout(REAL_TIER_TIMEOUT_S), append=False)
