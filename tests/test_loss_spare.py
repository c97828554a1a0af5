"""A spare never takes the server of a live consumer, loss or not. Redis loses the run (FLUSHALL):
the server leases go with it, the spare waits instead of taking the server (and crashing on the
unknown run); Redis comes back (restarted, its AOF): the driving consumer re-takes its lease
before any spare may. The holder is paused for half its lease at the moment that matters, so its
renewal comes after the spare's next poll (the race is decided, not left to chance)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from conftest import genq
from faultkit import claims, private_redis, produce_once, sim_kwargs
from pipeline import wait_for, write_dataset
from test_server_leasing import LEASE_S, Replica, Watch

from genq.common.data import manifest as manifests
from genq.common.queue.keys import RunKeys, server_lease
from genq.consumer.servers import identity

N = 160
PAUSE_S = LEASE_S / 2 + 0.2  # longer than the spare's poll, within the holder's lease


def holder_and_spare(url: str, run: str, server: str, out: Path) -> list[Replica]:
    holder = Replica(url, run, [server], out, "holder")
    wait_for(holder.driving, timeout=30, what="the holder driving")
    spare = Replica(url, run, [server], out, "spare")
    wait_for(lambda: spare.said("server_busy"), timeout=30, what="the spare waiting")
    return [holder, spare]


def paused(holder: Replica, what) -> None:
    """Do `what` while the holder is stopped for PAUSE_S (within its lease)."""
    holder.signal(signal.SIGSTOP)
    try:
        what()
        time.sleep(PAUSE_S)
    finally:
        holder.signal(signal.SIGCONT)


def wait_held_by_holder(r, server: str, replicas: list[Replica]) -> None:
    try:
        wait_for(lambda: (r.get(server_lease(identity(server))) or b"").startswith(b"holder|"),
                 timeout=10, what="the holder holding its server lease again")
    except AssertionError as e:
        raise AssertionError("\n".join([str(e), *(c.log()[-2000:] for c in replicas)])) from None


def finish(holder: Replica, spare: Replica, watch: Watch) -> None:
    """The holder drives the run to its end; the spare never drove, never crashed."""
    assert holder.wait(150) == 0, holder.log()[-4000:]
    assert spare.wait(30) == 0, spare.log()[-4000:]
    watch.stop.set()
    watch.join()
    assert watch.seen == [], f"the server driven twice at once: {watch.seen[:3]}"
    assert not spare.driving() and not spare.said("server_leased"), spare.log()[-3000:]
    assert not holder.said("server_lease_lost")


@pytest.mark.slow  # a Redis loss, waited out in server leases
@pytest.mark.timeout(240)
def test_a_spare_waits_through_a_loss_and_the_recover(tmp_path, run_name, sim_factory):
    sim = sim_factory(**sim_kwargs(0.4, max_running_requests=4))
    out, k = tmp_path / "out", RunKeys(run_name)
    with private_redis() as srv:  # no AOF: FLUSHALL is a loss
        r = srv.client()
        produce_once(write_dataset(tmp_path / "d.jsonl", N), srv.url, run_name)
        replicas = holder_and_spare(srv.url, run_name, sim.url, out)
        holder, spare = replicas
        watch = Watch(replicas)
        watch.start()
        try:
            wait_for(lambda: r.bitcount(k.done) >= 10 and manifests.find(out, run_name),
                     timeout=60, what="10 done")
            paused(holder, r.flushall)
            wait_held_by_holder(r, sim.url, replicas)  # during the loss
            wait_for(lambda: holder.said("run_state_lost"), timeout=10, what="the loss seen")
            time.sleep(LEASE_S)  # the spare waits for the run, alive
            assert spare.alive(), spare.log()[-3000:]
            assert not r.exists(k.meta)
            genq("recover", "--shards", str(out), redis_url=srv.url, run=run_name)
            finish(holder, spare, watch)
            assert int(r.bitcount(k.done)) == N
        finally:
            watch.stop.set()
            for c in replicas:
                c.cleanup()
            r.close()


@pytest.mark.slow  # a Redis loss, waited out in server leases
@pytest.mark.timeout(240)
def test_a_holder_paused_as_redis_comes_back_keeps_its_server(tmp_path, run_name, sim_factory):
    """Redis down longer than the server lease (its key expires), back from its AOF: the spare
    sees a free server, but its holder is alive and re-takes it."""
    sim = sim_factory(**sim_kwargs(0.4, max_running_requests=4))
    out, k = tmp_path / "out", RunKeys(run_name)
    with private_redis("--appendonly", "yes") as srv:
        r = srv.client()
        produce_once(write_dataset(tmp_path / "d.jsonl", N), srv.url, run_name)
        replicas = holder_and_spare(srv.url, run_name, sim.url, out)
        holder, spare = replicas
        watch = Watch(replicas)
        watch.start()
        try:
            wait_for(lambda: r.bitcount(k.done) >= 10, timeout=60, what="10 done")
            srv.stop(kill=True)
            time.sleep(LEASE_S + 0.5)
            paused(holder, srv.start)
            r = srv.client()
            wait_held_by_holder(r, sim.url, replicas)
            finish(holder, spare, watch)
            assert int(r.bitcount(k.done)) == N
        finally:
            watch.stop.set()
            for c in replicas:
                c.cleanup()
            r.close()



@pytest.mark.slow  # a Redis loss, waited out in server leases
@pytest.mark.timeout(240)
def test_a_holder_frozen_across_a_loss_claims_nothing_once_its_server_is_taken(
        tmp_path, run_name, sim_factory):
    """Frozen past its server lease while Redis restarted empty, `genq recover` ran and a spare
    took its server: resumed, the holder claims nothing (the lease is not known to be its own
    until renewed), then stops (exit 3). Its first renewal failed on the dead connection, and
    it claimed meanwhile: two consumers' requests on one server."""
    sim = sim_factory(**sim_kwargs(0.4, max_running_requests=4))
    out, k = tmp_path / "out", RunKeys(run_name)
    with private_redis() as srv:  # no AOF: a restart is a loss
        r = srv.client()
        produce_once(write_dataset(tmp_path / "d.jsonl", N), srv.url, run_name)
        holder = Replica(srv.url, run_name, [sim.url], out, "holder")
        try:
            wait_for(lambda: r.bitcount(k.done) >= 10 and manifests.find(out, run_name),
                     timeout=60, what="10 done")
            holder.signal(signal.SIGSTOP)
            r.close()
            srv.stop(kill=True)
            srv.start()
            r = srv.client()
            genq("recover", "--shards", str(out), redis_url=srv.url, run=run_name)
            # the spare that waited it out
            r.set(server_lease(identity(sim.url)), "spare|x|1", px=60_000)
            before = sum(claims(r, run_name, N))
            time.sleep(LEASE_S)  # the holder frozen past its lease
            holder.signal(signal.SIGCONT)
            assert holder.wait(60) == 3, holder.log()[-3000:]
            assert sum(claims(r, run_name, N)) == before, "claimed without its server lease"
        finally:
            holder.cleanup()
            r.close()
