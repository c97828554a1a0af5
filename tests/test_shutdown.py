"""Stopping a consumer: it must stop on SIGTERM/SIGINT whatever else is broken (its log pipe
gone, Redis gone), within its grace plus a bounded wait, and give back what it held."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import orjson
import pytest
from conftest import REPO, genq_env
from faultkit import VT, Consumer, check_truth, owners, private_redis, produce_once, sim_kwargs
from pipeline import wait_for, write_dataset

from genq.common.queue.keys import RunKeys

# --grace 2 (BASE_FLAGS), then at most 5 s for slots waiting on Redis, then the goodbye: a
# consumer must be gone well within this. A hang shows up as a failure, not a slow test.
EXIT_BOUND_S = 30


def working(r, run: str, name: str) -> bool:
    """The consumer has started and holds at least one task (its heartbeat says so)."""
    raw = r.get(RunKeys(run).consumer(name))
    return bool(raw) and orjson.loads(raw).get("inflight", 0) > 0


def finish(r, redis_url: str, run: str, n: int, tmp_path, sim_factory) -> None:
    """Finish the run with a fresh consumer and check nothing was lost or counted twice."""
    fast = sim_factory(**sim_kwargs(0.05))
    last = Consumer(redis_url, run, fast.url, tmp_path / "last", concurrency=16)
    try:
        assert last.wait(120) == 0, last.log()[-3000:]
    finally:
        last.cleanup()
    check_truth(r, redis_url, run, n, tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_consumer_stops_on_signal_after_its_log_pipe_died(
        tmp_path, redis_url, r, run_name, sim_factory, sig):
    """`genq consume ... 2>&1 | tee log`, then Ctrl-C: tee is gone, every log write fails."""
    n = 120
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(1.0))
    args = [sys.executable, "-m", "genq", "consume", "--server", sim.url, "--out",
            str(tmp_path / "a"), "--visibility-timeout", str(VT), "--concurrency", "4",
            "--burst", "--grace", "2", "--name", "piped"]
    consumer = subprocess.Popen(args, cwd=REPO, env=genq_env(redis_url, run_name),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tee = subprocess.Popen(["tee", str(tmp_path / "log")], stdin=consumer.stdout,
                           stdout=subprocess.DEVNULL)
    consumer.stdout.close()  # only tee reads the pipe: when tee dies, writes get EPIPE
    try:
        wait_for(lambda: working(r, run_name, "piped"), timeout=60, what="consumer working")
        tee.kill()
        tee.wait(10)
        consumer.send_signal(sig)
        try:
            rc = consumer.wait(EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {EXIT_BOUND_S}s after {sig.name} with its "
                                 "log pipe closed") from None
    finally:
        for proc in (consumer, tee):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert rc == 0
    assert owners(r, run_name) == {}, "its leases must be given back, not left to expire"
    finish(r, redis_url, run_name, n, tmp_path, sim_factory)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shutdown_loop_with_and_without_redis(tmp_path, run_name, sim_factory):
    """20 shutdowns of working consumers (10 rounds of 2); in every fifth round Redis is killed
    first. Each consumer must exit 0 within EXIT_BOUND_S. A consumer stopped during an outage
    used to wait for Redis forever (and redis-py retried each command for a minute by itself)."""
    n = 600
    with private_redis("--appendonly", "yes") as server:
        r = server.client()
        produce_once(write_dataset(tmp_path / "d.jsonl", n), server.url, run_name)
        sim = sim_factory(**sim_kwargs(0.5))
        for round_ in range(10):
            redis_down = round_ % 5 == 4
            names = [f"loop{round_}-{i}" for i in range(2)]
            consumers = [Consumer(server.url, run_name, sim.url, tmp_path / name, name=name)
                         for name in names]
            try:
                for name in names:
                    wait_for(lambda name=name: working(r, run_name, name), timeout=60,
                             what=f"{name} working")
                if redis_down:
                    server.stop(kill=True)
                for c in consumers:
                    c.signal(signal.SIGTERM)
                for c in consumers:
                    assert c.wait(EXIT_BOUND_S) == 0, c.log()[-3000:]
                if redis_down:
                    assert any(e.get("event") == "stopped_without_redis"
                               for c in consumers for e in c.events())
            finally:
                for c in consumers:
                    c.cleanup()
                if server.proc is None:
                    server.start()
        finish(r, server.url, run_name, n, tmp_path, sim_factory)
        r.close()


def test_background_loops_on_redis_end_when_cancelled(redis_url):
    """redis-py's asyncio client on Python 3.11 can swallow a task's cancellation (a cancel that
    lands as a command's write completes is lost inside asyncio.wait_for): a loop around Redis
    commands then survives cancel(), which is how a stopped consumer hung forever waiting for its
    housekeeping task. The consumer's loops end on a flag as well, and cancel_and_wait cancels
    until they are done; here with loops of the same shape on a real Redis."""
    import asyncio
    import random

    import redis.asyncio as aioredis

    from genq.consumer.shutdown import cancel_and_wait

    async def trials() -> tuple[int, int]:
        r = aioredis.Redis.from_url(redis_url)
        finished = False

        async def loop_on_redis() -> None:  # like Consumer.housekeeping
            while not finished:
                await r.get("genq-test-key")
                await asyncio.sleep(0.001)

        survived_one_cancel = ended = 0
        for _ in range(40):
            finished = False
            task = asyncio.create_task(loop_on_redis())
            await asyncio.sleep(random.uniform(0, 0.005))
            task.cancel()
            await asyncio.wait([task], timeout=0.5)
            survived_one_cancel += not task.done()
            finished = True
            await cancel_and_wait([task], bound=10)
            ended += task.done()
        await r.aclose()
        return survived_one_cancel, ended

    survived_one_cancel, ended = asyncio.run(trials())
    assert ended == 40, f"{40 - ended} loops still running after cancel_and_wait"
    # Not asserted (it depends on redis-py and timing), only shown.
    print(f"{survived_one_cancel} of 40 loops survived a single cancel()")


STUBBORN = """
import asyncio
from genq.common.errors import GenqError
from genq.consumer import shutdown

async def serve():
    async def stubborn():  # swallows every cancellation, as a lost one would look
        while True:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                pass
    asyncio.get_running_loop().create_task(stubborn())
    await asyncio.sleep(0)
    raise GenqError("the run was replaced")

asyncio.run(shutdown.to_the_end(serve()))
"""


def test_an_error_is_said_even_when_a_task_that_will_not_end_forces_the_exit():
    """The forced exit skips the command's own report of the error: it must be said anyway."""
    done = subprocess.run([sys.executable, "-c", STUBBORN], cwd=REPO, capture_output=True,
                          text=True, timeout=EXIT_BOUND_S)
    assert done.returncode == 1
    assert "genq: error: the run was replaced" in done.stderr


def test_the_first_signal_says_a_second_stops_at_once_and_a_second_does(
        tmp_path, redis_url, r, run_name, sim_factory):
    """Ctrl-C drains for --grace; its line says that a second Ctrl-C gives everything back at
    once, and a second one does (here long before the 120 s grace)."""
    produce_once(write_dataset(tmp_path / "d.jsonl", 40), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(5.0))
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--grace", "120", name="twice")
    try:
        wait_for(lambda: working(r, run_name, "twice"), timeout=60, what="consumer working")
        c.signal(signal.SIGINT)
        [first] = wait_for(lambda: [e for e in c.events() if e.get("event") == "stopping"],
                           what="the stopping line")
        assert "a second Ctrl-C" in first.get("then", ""), first
        c.signal(signal.SIGINT)
        assert c.wait(EXIT_BOUND_S) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    assert owners(r, run_name) == {}, "its leases must be given back, not left to expire"


def test_a_sigterm_repeated_at_once_is_the_same_stop(tmp_path, redis_url, r, run_name,
                                                     sim_factory):
    """Slurm signals every process of a task and the task's script passes the signal on: two
    SIGTERMs at once drain as one (no abort), and a SIGTERM seconds later still aborts."""
    produce_once(write_dataset(tmp_path / "d.jsonl", 40), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(5.0))
    c = Consumer(redis_url, run_name, sim.url, tmp_path / "out", "--grace", "120", name="slurm")
    try:
        wait_for(lambda: working(r, run_name, "slurm"), timeout=60, what="consumer working")
        c.signal(signal.SIGTERM)
        time.sleep(0.3)  # two signals sent at once would merge into one pending signal
        c.signal(signal.SIGTERM)
        wait_for(lambda: [e for e in c.events() if e.get("event") == "stopping"],
                 what="the stopping line")
        time.sleep(2.5)
        assert c.proc.poll() is None, "two SIGTERMs at once aborted the drain"
        assert [e.get("event") for e in c.events()].count("stopping") == 1
        c.signal(signal.SIGTERM)
        assert c.wait(EXIT_BOUND_S) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
    assert owners(r, run_name) == {}
