"""A fresh deployment starts at once: `genq produce` on a Redis that has just started registers
its run without waiting, unless something says this run was lost there; a run Redis lost under
the producer that registered it is still not registered anew at once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import genq
from faultkit import Background, private_redis
from pipeline import wait_for, write_dataset

from genq.common.queue.keys import RunKeys

ROWS = 1_000_000


def big_dataset(path: Path, n: int) -> Path:
    """n one-message rows, written in one go (a million in about a second)."""
    row = '{"id": "p%d", "messages": [{"role": "user", "content": "Write program number %d."}]}\n'
    path.write_text("".join(row % (i, i) for i in range(n)))
    return path


def decided(service: Background) -> list[dict]:
    return [e for e in service.events()
            if e.get("event") in ("run_absent_after_restart", "run_registered")]


@pytest.mark.timeout(120)
def test_a_new_run_on_a_fresh_redis_queues_its_first_task_at_once(tmp_path, run_name):
    data = big_dataset(tmp_path / "d.jsonl", ROWS)
    k = RunKeys(run_name)
    args = ("produce", str(data), "--window", "64", "--interval", "0.1")
    with private_redis() as srv:  # started just now, as a fresh deployment's
        url, r = srv.url, srv.client()
        start = time.monotonic()
        first = Background(url, run_name, *args)
        again = None
        try:
            wait_for(lambda: r.llen(k.rq_queue) > 0, timeout=30, interval=0.02,
                     what="the first task queued")
            took = time.monotonic() - start
            assert took < 2.0, f"first task queued {took:.1f} s after produce:\n{first.log()}"
            assert [e["event"] for e in decided(first)] == ["run_registered"]
            assert first.stop() == 0
            # Redis restarts empty under the run: a producer started again must not register
            # it anew before its consumers could say they wait for it.
            srv.stop(kill=True)
            srv.start()
            again = Background(url, run_name, *args)
            said = wait_for(lambda: decided(again), timeout=30, what="the producer deciding")
            assert said[0]["event"] == "run_absent_after_restart", said
            assert not r.exists(k.meta)
        finally:
            for service in (first, again):
                if service is not None:
                    service.cleanup()
        r.close()


def test_a_machine_that_cannot_keep_the_mark_still_registers_and_says_so(
        tmp_path, run_name, redis_url, r, monkeypatch):
    blocker = tmp_path / "state"
    blocker.write_text("a file where the state directory should be\n")
    monkeypatch.setenv("XDG_STATE_HOME", str(blocker))
    data = write_dataset(tmp_path / "d.jsonl", 10)
    done = genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    assert r.exists(RunKeys(run_name).meta)
    assert "enqueued 10 of 10" in done.stdout
    assert "run_mark_not_kept" in done.stderr, done.stderr
