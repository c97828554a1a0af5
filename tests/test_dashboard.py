"""rq-dashboard as the compose stack runs it (`python -m genq.dashboard`): it shows the run's
queues, and its buttons are refused unless --allow-write is given."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from conftest import REPO, free_port, genq, genq_env, wait_port
from pipeline import write_dataset

from genq.common.queue.keys import RunKeys


def dashboard(redis_url: str, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "genq.dashboard", "--port", str(port),
                             "--redis-url", redis_url, *flags], cwd=REPO,
                            env=genq_env(redis_url, "unused"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_port(port)
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("allow_write", [False, True])
def test_dashboard_is_read_only_unless_asked(tmp_path, redis_url, run_name, allow_write):
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", 5)), "--once",
         redis_url=redis_url, run=run_name)
    q = RunKeys(run_name).queue_name
    proc, url = dashboard(redis_url, *(["--allow-write"] if allow_write else []))
    try:
        queues = httpx.get(f"{url}/0/data/queues.json", timeout=10).json()["queues"]
        assert {x["name"]: x["count"] for x in queues}[q] == 5
        writes = [httpx.post(f"{url}/requeue/{q}", timeout=10),
                  httpx.get(f"{url}/requeue/{q}", timeout=10),
                  httpx.post(f"{url}/queue/{q}/queued/empty", timeout=10)]
        if allow_write:
            assert [w.status_code for w in writes] == [200, 200, 200]
        else:
            assert [w.status_code for w in writes] == [403, 403, 403]
            assert "genq requeue" in writes[0].text
            # Nothing was emptied.
            queues = httpx.get(f"{url}/0/data/queues.json", timeout=10).json()["queues"]
            assert {x["name"]: x["count"] for x in queues}[q] == 5
    finally:
        proc.terminate()
        proc.wait(timeout=10)
