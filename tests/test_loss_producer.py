"""A producer (re)started while Redis has lost its run, consumers waiting for the recover, waits
for `genq recover` as they do: registering the run anew (a new epoch) would make every consumer
exit and the recover need --replace."""

from __future__ import annotations

import signal

import pytest
from conftest import genq
from faultkit import Background, Consumer, check_truth, private_redis, sim_kwargs
from pipeline import wait_for, write_dataset

from genq.common.queue import heartbeats
from genq.common.queue.keys import RunKeys
from genq.common.report import runhealth

N = 100


@pytest.mark.slow  # a Redis loss and recover
@pytest.mark.timeout(240)
def test_a_producer_started_while_its_run_is_lost_waits_for_the_recover(
        tmp_path, run_name, sim_factory):
    data = write_dataset(tmp_path / "d.jsonl", N)
    sim = sim_factory(**sim_kwargs(0.3))
    out, k = tmp_path / "out", RunKeys(run_name)
    args = ("produce", str(data), "--max-tokens", "300", "--window", "8", "--interval", "0.1")
    with private_redis() as srv:  # no AOF: FLUSHALL is a loss
        url, r = srv.url, srv.client()
        first = Background(url, run_name, *args)
        again = consumer = None
        try:
            wait_for(lambda: r.exists(k.meta), what="the producer registered the run")
            consumer = Consumer(url, run_name, sim.url, out)
            wait_for(lambda: r.bitcount(k.done) >= 15, timeout=60, what="15 done")
            assert first.stop() == 0
            r.flushall()
            wait_for(lambda: any(b.get("run_state") == "lost"
                                 for b in heartbeats.read(r, k).values()),
                     timeout=20, what="the consumer waiting for the run")
            again = Background(url, run_name, *args)  # restarted while the run is lost
            said = wait_for(lambda: [e for e in again.events() if e.get("event") in
                                     ("run_state_lost", "run_registered")],
                            timeout=30, what="the producer saying it waits")
            assert said[0]["event"] == "run_state_lost", (
                f"the lost run registered anew (epoch {r.hget(k.meta, 'epoch')}); consumer "
                f"exit {consumer.wait(30)}:\n{consumer.log()[-1500:]}")
            assert f"genq recover --shards {out}" in said[0]["command"], said
            assert not r.exists(k.meta)
            genq("recover", "--shards", str(out), redis_url=url, run=run_name)
            assert consumer.wait(120) == 0, consumer.log()[-4000:]
            assert [e for e in again.events() if e.get("event") == "run_registered"]
            assert again.stop() == 0, again.log()[-3000:]
        finally:
            for service in (first, again, consumer):
                if service is not None:
                    service.cleanup()
        check_truth(r, url, run_name, N, tmp_path)
        r.close()


@pytest.mark.slow  # a Redis loss
@pytest.mark.timeout(240)
def test_a_producer_restarted_right_after_redis_restarts_empty_waits_for_the_consumers(
        tmp_path, run_name, sim_factory):
    """A producer that starts before any consumer has looked at a Redis restarted empty (one
    paused here, as a loaded node's may be) must not register the run anew: it waits until the
    consumers could have said they wait for it, and then waits for the recover."""
    data = write_dataset(tmp_path / "d.jsonl", N)
    sim = sim_factory(**sim_kwargs(0.3))
    out, k = tmp_path / "out", RunKeys(run_name)
    args = ("produce", str(data), "--max-tokens", "300", "--window", "8", "--interval", "0.1")
    with private_redis() as srv:  # no AOF: a restart is a loss
        url, r = srv.url, srv.client()
        first = Background(url, run_name, *args)
        again = consumer = None
        try:
            wait_for(lambda: r.exists(k.meta), what="the producer registered the run")
            consumer = Consumer(url, run_name, sim.url, out)
            wait_for(lambda: r.bitcount(k.done) >= 15, timeout=60, what="15 done")
            assert first.stop() == 0
            consumer.signal(signal.SIGSTOP)
            srv.stop(kill=True)
            srv.start()
            again = Background(url, run_name, *args)  # before the consumer has looked
            said = wait_for(lambda: [e for e in again.events() if e.get("event") in
                                     ("run_absent_after_restart", "run_registered")],
                            timeout=30, what="the producer deciding")
            consumer.signal(signal.SIGCONT)
            assert said[0]["event"] == "run_absent_after_restart", (
                f"the lost run registered anew; consumer exit {consumer.wait(30)}:\n"
                f"{consumer.log()[-1500:]}")
            said = wait_for(lambda: [e for e in again.events() if e.get("event") in
                                     ("run_state_lost", "run_registered")],
                            timeout=30, what="the producer saying it waits")
            assert said[0]["event"] == "run_state_lost", said
            genq("recover", "--shards", str(out), redis_url=url, run=run_name)
            assert consumer.wait(120) == 0, consumer.log()[-4000:]
            assert again.stop() == 0, again.log()[-3000:]
        finally:
            for service in (first, again, consumer):
                if service is not None:
                    service.cleanup()
        check_truth(r, url, run_name, N, tmp_path)
        r.close()


@pytest.mark.slow  # waits out a just-started Redis's 8 s settle, a Redis loss and recover
@pytest.mark.timeout(240)
def test_a_consumer_started_while_its_run_is_lost_waits_for_the_recover(
        tmp_path, run_name, sim_factory):
    """A consumer (re)started between Redis coming back empty and `genq recover` (a node's
    restart in that window; found by bench/chaos.py --turns all) waits for the recover as the
    running ones do, instead of exiting 2 on an "unknown run"."""
    data = write_dataset(tmp_path / "d.jsonl", N)
    sim = sim_factory(**sim_kwargs(0.3))
    out, k = tmp_path / "out", RunKeys(run_name)
    with private_redis() as srv:  # no AOF: FLUSHALL is a loss
        url, r = srv.url, srv.client()
        genq("produce", str(data), "--once", "--max-tokens", "300", redis_url=url, run=run_name)
        first = Consumer(url, run_name, sim.url, out)
        late = None
        try:
            wait_for(lambda: r.bitcount(k.done) >= 15, timeout=60, what="15 done")
            r.flushall()
            wait_for(lambda: runhealth.waiting(r, k), timeout=20,
                     what="the consumer waiting for the run")
            late = Consumer(url, run_name, sim.url, tmp_path / "late", name="late")
            said = wait_for(lambda: late.proc.poll() is not None or [
                e for e in late.events() if e.get("event") == "run_state_lost"],
                timeout=30, what="the late consumer waiting or exiting")
            assert said is not True and late.proc.poll() is None, late.log()[-1500:]
            genq("recover", "--shards", str(out), redis_url=url, run=run_name)
            for consumer in (first, late):
                assert consumer.wait(120) == 0, consumer.log()[-4000:]
            assert [e for e in late.events() if e.get("event") == "consumer_started"]
        finally:
            for service in (first, late):
                if service is not None:
                    service.cleanup()
        check_truth(r, url, run_name, N, tmp_path)
        r.close()
