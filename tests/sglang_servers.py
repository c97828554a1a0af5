"""SGLang servers for the scenario tests, behind one interface: the simulator, or a REAL
SGLang 0.5.23 started by scripts/real-sglang.sh (the `real_sglang` tier, run by .ci/run as
`pytest -m real_sglang`). Two launch modes, as users launch servers:

- "tuned": --max-running-requests 16, --reasoning-parser qwen3, --enable-metrics
- "plain": only the model (no --max-running-requests, no reasoning parser)
- "cache": "tuned" and --enable-cache-report (answers say their prefix-cache hits)
- "tools": "tuned" and --tool-call-parser qwen (qwen25's name in 0.5.23: answers to requests
  with tools have calls) and --enable-cache-report
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import REPO, free_port
from sim_fixtures import SimProcess, sim_flags

SCRIPT = REPO / "scripts" / "real-sglang.sh"
CONTEXT = 8192  # the real tiny model's; the simulator is given the same
TUNED_CAPACITY = 16
SIM_PLAIN_CAPACITY = 40
MODES = {
    "tuned": {"MAX_RUNNING": str(TUNED_CAPACITY),
              "EXTRA_ARGS": "--reasoning-parser qwen3 --enable-metrics"},
    "plain": {"MAX_RUNNING": "", "EXTRA_ARGS": ""},
    "cache": {"MAX_RUNNING": str(TUNED_CAPACITY),
              "EXTRA_ARGS": "--reasoning-parser qwen3 --enable-metrics --enable-cache-report"},
    "tools": {"MAX_RUNNING": str(TUNED_CAPACITY),
              "EXTRA_ARGS": "--reasoning-parser qwen3 --tool-call-parser qwen "
                            "--enable-cache-report --enable-metrics"},
}


class Server:
    kind: str
    url: str
    mode: str

    def restart(self, mode: str | None = None) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def token_counters(self) -> tuple[float, float]:
        """The server's own (prompt, generation) token totals from /metrics, all labels."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        sums = {"prompt": 0.0, "generation": 0.0}
        for name in sums:
            for m in re.finditer(rf"^sglang:{name}_tokens_total(?:{{[^}}]*}})? (\S+)$", text,
                                 re.M):
                sums[name] += float(m.group(1))
        return sums["prompt"], sums["generation"]

    def prompt_tokens(self, text: str) -> int:
        """What the server counts for this prompt (chat template included)."""
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
        r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)
        r.raise_for_status()
        return int(r.json()["usage"]["prompt_tokens"])


class SimServer(Server):
    kind = "sim"

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.port = free_port()
        self.sim: SimProcess | None = None
        self.restart(mode)

    def restart(self, mode: str | None = None) -> None:
        if self.sim is not None:
            self.sim.cleanup()
        self.mode = mode or self.mode
        tuned = self.mode != "plain"
        flags = sim_flags(
            time_scale=40, length_dist="lognormal:20:0.6", context_length=CONTEXT,
            max_running_requests=TUNED_CAPACITY if tuned else None,
            effective_max_running=SIM_PLAIN_CAPACITY,
            reasoning_parser="qwen3" if tuned else None,
            enable_cache_report=self.mode == "cache")
        self.sim = SimProcess(*flags, port=self.port).start()
        self.url = self.sim.url

    def kill(self) -> None:
        assert self.sim is not None
        self.sim.kill()

    def close(self) -> None:
        if self.sim is not None:
            self.sim.cleanup()


class RealServer(Server):
    """A real SGLang 0.5.23 server on a free port; fails the test (never skips) if the
    script cannot build or start it."""
    kind = "real"

    def __init__(self, mode: str) -> None:
        self.mode = mode
        # free_port() only finds a port free now: another server's own ports (SGLang takes
        # several for its processes) may take it before this one binds it. Another port, then.
        for attempt in range(3):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            started = self._script("start", mode)
            taken = "address already in use" in started.stdout + started.stderr
            if started.returncode == 0 or not taken or attempt == 2:
                break
        self._started(started)

    def _script(self, action: str, mode: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PORT": str(self.port), **MODES[mode]}
        return subprocess.run([str(SCRIPT), action], env=env, capture_output=True, text=True,
                              timeout=900)

    def restart(self, mode: str | None = None) -> None:
        self.mode = mode or self.mode
        self._started(self._script("start", self.mode))

    @staticmethod
    def _started(started: subprocess.CompletedProcess) -> None:
        if started.returncode != 0:
            pytest.fail(f"real SGLang did not start ({SCRIPT} start):\n"
                        f"{started.stdout[-3000:]}\n{started.stderr[-3000:]}")

    def pid_file(self) -> Path:
        base = os.environ.get("BASE") or Path(
            os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "genq-real-sglang"
        return Path(base) / "run" / f"server-{self.port}.pid"

    def send(self, sig: signal.Signals) -> int:
        """Send `sig` to the server's whole process group; its leader's pid."""
        pid = int(self.pid_file().read_text())
        os.killpg(pid, sig)
        return pid

    def kill(self) -> None:
        """SIGKILL the server's whole process group, as a crash would end it."""
        pid = self.send(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)

    def close(self) -> None:
        self._script("stop", self.mode)


class SharedRealServer(RealServer):
    """The session's real server of a mode: a start costs ~30 s of the real tier's two cores,
    and most scenarios only send it requests. Handed out idle, with its prefix cache flushed;
    `close` pauses it (SIGSTOP) until the next test: an idle SGLang scheduler on CPU polls,
    taking most of a core (tests/conftest.py stops it at the session's end). A test that kills
    or restarts its server starts its own (`own=True`)."""

    def close(self) -> None:
        self.send(signal.SIGSTOP)

    def stop(self) -> None:
        self.send(signal.SIGCONT)
        super().close()

    def quiet(self, timeout: float = 120) -> SharedRealServer:
        self.send(signal.SIGCONT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            load = httpx.get(self.url + "/v1/loads", timeout=10).json()["loads"]
            busy = sum(x["num_running_reqs"] + x["num_waiting_reqs"] for x in load)
            if not busy and httpx.post(self.url + "/flush_cache", timeout=10).is_success:
                return self
            time.sleep(0.2)
        pytest.fail(f"the shared real server on {self.url} still busy after {timeout} s")


SHARED: dict[str, SharedRealServer] = {}


def start_server(kind: str, mode: str, own: bool = False) -> Server:
    if kind == "sim":
        return SimServer(mode)
    if own:
        return RealServer(mode)
    if mode not in SHARED:
        SHARED[mode] = SharedRealServer(mode)
    return SHARED[mode].quiet()


def stop_shared() -> None:
    while SHARED:
        SHARED.popitem()[1].stop()


# Each scenario runs against both; the real ones only in the real-server tier.
KINDS = [pytest.param("sim"), pytest.param("real", marks=pytest.mark.real_sglang)]


def server_fixture(mode: str):
    """A test module's `server` fixture (`server = server_fixture(mode)`): a server of each of
    KINDS in `mode`, shared by the module's tests, stopped after them."""
    @pytest.fixture(scope="module", params=KINDS, name="server")
    def server(request):
        started = start_server(request.param, mode)
        yield started
        started.close()
    return server
