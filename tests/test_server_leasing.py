"""Identical consumer replicas given one list of servers (GENQ_SERVERS) lease one server each;
an extra replica waits as a spare and takes over the server of a consumer that died; a consumer
pointed at a server someone already drives says so and waits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, genq, genq_env
from faultkit import Background, sim_kwargs
from pipeline import ConsumerProcess, read_jsonl, wait_for, write_dataset
from timescale import GRACE, SERVER_LEASE

from genq.common.queue.keys import RunKeys, server_lease
from genq.consumer.servers import identity, pid_space, process_start, provably_gone

# Renewed every third of it: a driver on a loaded machine is not mistaken for a dead one.
LEASE_S = SERVER_LEASE


class Replica(ConsumerProcess):
    """`genq consume` as a compose replica starts it: no --server, only GENQ_SERVERS."""

    def __init__(self, redis_url: str, run: str, servers: list[str], out: Path, name: str,
                 *flags: str) -> None:
        self.name = name
        self.log_path = Path(tempfile.mkstemp(prefix="genq-replica-", suffix=".log")[1])
        args = [sys.executable, "-m", "genq", "consume", "--out", str(out), "--name", name,
                "--burst", "--server-lease", str(LEASE_S), "--visibility-timeout", str(LEASE_S),
                "--poll", "0.05", "--grace", str(GRACE), *flags]
        env = {**genq_env(redis_url, run), "GENQ_SERVERS": ",".join(servers)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def driving(self) -> list[str]:
        """The servers this replica started driving, in order (a replica drives one at most)."""
        return [e["leased"] for e in self.events() if e.get("event") == "server_leased"]

    def said(self, event: str) -> list[dict]:
        return [e for e in self.events() if e.get("event") == event]


def drivers(replicas: list[Replica]) -> dict[str, list[str]]:
    """Server -> the replicas driving it now: started on it, alive, lease not yet given back."""
    out: dict[str, list[str]] = {}
    for c in list(replicas):
        if c.alive() and not c.said("server_released"):
            for url in c.driving():
                out.setdefault(url, []).append(c.name)
    return out


def no_server_driven_twice(replicas: list[Replica]) -> None:
    for url, names in drivers(replicas).items():
        assert len(names) == 1, f"{url} driven by {names} at once"


class Watch(threading.Thread):
    """Looks at who drives what ten times a second for the whole test."""

    def __init__(self, replicas: list[Replica]) -> None:
        super().__init__(daemon=True)
        self.replicas, self.stop, self.seen = replicas, threading.Event(), []

    def run(self) -> None:
        while not self.stop.wait(0.1):
            self.seen += [(url, names) for url, names in drivers(self.replicas).items()
                          if len(names) > 1]


@pytest.mark.slow  # a kill and a spare's take-over
@pytest.mark.timeout(150)
def test_three_replicas_two_servers_one_spare_takes_over(tmp_path, redis_url, r, run_name,
                                                         sim_factory):
    n = 400
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", n)), "--once", "--max-tokens",
         "300", redis_url=redis_url, run=run_name)
    sims = [sim_factory(**sim_kwargs(0.3, max_running_requests=4)) for _ in range(2)]
    urls = [s.url for s in sims]
    k = RunKeys(run_name)
    replicas = [Replica(redis_url, run_name, urls, tmp_path / "out", f"c{i}") for i in range(3)]
    watch = Watch(replicas)
    watch.start()
    try:
        wait_for(lambda: sum(bool(c.driving()) for c in replicas) == 2
                 and any(c.said("spare_waiting") for c in replicas), timeout=30,
                 what="two replicas driving, one waiting as a spare")
        no_server_driven_twice(replicas)
        assert sorted(drivers(replicas)) == sorted(urls)
        spare = next(c for c in replicas if not c.driving())
        # The spare names who drives each server; Redis holds one lease per server.
        assert set(spare.said("spare_waiting")[0]["driven_by"]) == set(urls)
        for url in urls:
            owner = r.get(server_lease(identity(url))).decode().split("|")[0]
            assert drivers(replicas)[url] == [owner]

        # A consumer pointed at a driven server by hand says so and does not drive it.
        intruder = Replica(redis_url, run_name, [urls[1]], tmp_path / "out", "intruder")
        replicas.append(intruder)
        wait_for(lambda: intruder.said("server_busy"), timeout=20, what="intruder says busy")
        assert drivers(replicas)[urls[1]][0] in intruder.said("server_busy")[0]["driven_by"][
            urls[1]]

        victim = next(c for c in replicas if c.driving() == [urls[0]])
        done_before = int(r.bitcount(k.done))
        victim.kill()
        killed_at = time.monotonic()
        wait_for(lambda: spare.driving() == [urls[0]], timeout=10 * LEASE_S,
                 what="the spare taking over the dead consumer's server")
        takeover_s = time.monotonic() - killed_at
        no_server_driven_twice(replicas)
        assert not intruder.driving()
        assert done_before < n, "the run ended before the kill; make it longer"

        for c in replicas:
            if c is not victim:
                assert c.wait(90) == 0, c.log()[-3000:]
    finally:
        watch.stop.set()
        watch.join()
        for c in replicas:
            c.cleanup()
    assert watch.seen == [], f"servers driven twice at once: {watch.seen[:3]}"
    assert int(r.bitcount(k.done)) == n
    # Every lease is given back on a clean exit; the dead consumer's one expired.
    assert not any(r.exists(server_lease(identity(url))) for url in urls)
    genq("export", "--out", str(tmp_path / "all.jsonl"), redis_url=redis_url, run=run_name)
    assert sorted(rec["index"] for rec in read_jsonl(tmp_path / "all.jsonl")) == list(range(n))
    # A figure, not a bound: the server is idle for at most the lease plus one poll.
    print(f"takeover_s={takeover_s:.2f} lease_s={LEASE_S}")


def test_a_lost_lease_stops_the_consumer(tmp_path, redis_url, r, run_name, sim_factory):
    """A consumer whose lease another one took (it was frozen past the lease) stops driving."""
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", 200)), "--once", "--max-tokens",
         "300", redis_url=redis_url, run=run_name)
    sim = sim_factory(**sim_kwargs(0.3, max_running_requests=4))
    c = Replica(redis_url, run_name, [sim.url], tmp_path / "out", "frozen")
    try:
        wait_for(lambda: c.driving(), timeout=20, what="the consumer driving")
        c.signal(signal.SIGSTOP)
        wait_for(lambda: not r.exists(server_lease(identity(sim.url))), timeout=10 * LEASE_S,
                 what="the frozen consumer's lease expiring")
        r.set(server_lease(identity(sim.url)), "other|x|1", px=60_000)
        c.signal(signal.SIGCONT)
        assert c.wait(60) == 3, c.log()[-3000:]
        assert c.said("server_lease_lost")
        assert r.get(server_lease(identity(sim.url))) == b"other|x|1"
    finally:
        c.cleanup()


def token_of(pid: int, start: str | None, space: str | None = None) -> str:
    return f"c|run|{space if space is not None else pid_space()}|{pid}|{start}|0f"


def test_a_holder_is_provably_gone_only_when_its_process_is():
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        started = process_start(alive.pid)
        assert started  # this test runs on Linux
        assert not provably_gone(token_of(alive.pid, started))  # alive: never displaced
        assert provably_gone(token_of(dead.pid, "1"))  # no such process
        assert provably_gone(token_of(alive.pid, "1"))  # its pid reused by another process
        assert not provably_gone(token_of(dead.pid, "1", space="other-host/boot/pid:[1]"))
        assert not provably_gone("c|run|0f")  # a token that says nothing of its process
        assert not provably_gone(None)
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.slow  # a kill -9 and take-over
def test_a_consumer_killed_and_run_again_takes_over_at_once(tmp_path, redis_url, r, run_name,
                                                           sim_factory):
    """The restart users do most: kill -9, the same command at once. Leases of 30 s would keep
    the server idle for 30 s if the new consumer had to wait them out."""
    n = 120
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", n)), "--once", "--max-tokens",
         "300", redis_url=redis_url, run=run_name)
    sim = sim_factory(**sim_kwargs(1.0, max_running_requests=8))
    k = RunKeys(run_name)
    slow = ("--server-lease", "30", "--visibility-timeout", "30")
    first = Replica(redis_url, run_name, [sim.url], tmp_path / "out", "first", *slow)
    second = None
    try:
        wait_for(lambda: r.zcard(k.leases) >= 8, timeout=30, what="the first consumer busy")
        first.kill()
        relaunched = time.monotonic()
        second = Replica(redis_url, run_name, [sim.url], tmp_path / "out", "second", *slow)
        wait_for(lambda: second.driving(), timeout=15, what="the relaunched consumer driving")
        driving_s = time.monotonic() - relaunched
        # server_leased is said before the dead holder's leases are ended and logged
        wait_for(lambda: second.said("server_taken_over"), timeout=15, what="the take-over")
        [taken] = second.said("server_taken_over")
        assert taken["leases_ended"] >= 8 and taken["tasks_returned"] >= 8
        assert "first" in taken["predecessor"]
        assert second.wait(90) == 0, second.log()[-3000:]
    finally:
        first.cleanup()
        if second is not None:
            second.cleanup()
    assert driving_s < 10, f"the relaunched consumer waited {driving_s:.1f} s"
    assert int(r.bitcount(k.done)) == n
    genq("export", "--out", str(tmp_path / "all.jsonl"), redis_url=redis_url, run=run_name)
    assert sorted(rec["index"] for rec in read_jsonl(tmp_path / "all.jsonl")) == list(range(n))


def process_state(pid: int) -> str:
    """/proc/PID/stat's state letter: Z for a zombie (dead, its parent has not reaped it)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]


@pytest.mark.timeout(150)
def test_a_killed_holder_not_yet_reaped_is_taken_for_gone(tmp_path, redis_url, r, run_name,
                                                          sim_factory):
    """A consumer killed but not reaped by its parent (here, this test) keeps its pid and start
    time in /proc; it drives nothing, so the same command run again takes the server over at
    once rather than after a lease longer than this test waits."""
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", 40)), "--once", "--max-tokens",
         "300", redis_url=redis_url, run=run_name)
    sim = sim_factory(**sim_kwargs(1.0, max_running_requests=4))
    slow = ("--server-lease", "600", "--visibility-timeout", "30")
    first = Replica(redis_url, run_name, [sim.url], tmp_path / "out", "first", *slow)
    second = None
    try:
        wait_for(first.driving, timeout=30, what="the first consumer driving")
        os.kill(first.proc.pid, signal.SIGKILL)  # not waited for: it stays a zombie
        wait_for(lambda: process_state(first.proc.pid) == "Z", timeout=10, what="a zombie")
        second = Replica(redis_url, run_name, [sim.url], tmp_path / "out", "second", *slow)
        wait_for(lambda: second.said("server_taken_over"), timeout=60,
                 what="the relaunched consumer taking the zombie's server over")
        assert process_state(first.proc.pid) == "Z"  # never reaped meanwhile
        wait_for(second.driving, timeout=30, what="the relaunched consumer driving")
    finally:
        first.cleanup()
        if second is not None:
            second.cleanup()


@pytest.mark.timeout(150)
def test_a_spare_takes_over_as_soon_as_the_holder_dies(tmp_path, redis_url, r, run_name,
                                                       sim_factory):
    """A spare started within a lease of the holder's death proves it dead (same host, its
    process gone) at its next poll, rather than first waiting a lease from its own start."""
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", 40)), "--once", "--max-tokens",
         "300", redis_url=redis_url, run=run_name)
    sim = sim_factory(**sim_kwargs(1.0, max_running_requests=4))
    slow = ("--server-lease", "600", "--visibility-timeout", "30")
    holder = Replica(redis_url, run_name, [sim.url], tmp_path / "out", "holder", *slow)
    spare = None
    try:
        wait_for(holder.driving, timeout=30, what="the holder driving")
        spare = Replica(redis_url, run_name, [sim.url], tmp_path / "out", "spare", *slow)
        wait_for(lambda: spare.said("server_busy"), timeout=30, what="the spare waiting")
        holder.kill()
        wait_for(lambda: spare.said("server_taken_over"), timeout=60,
                 what="the spare taking the dead holder's server over")
        wait_for(spare.driving, timeout=30, what="the spare driving")
    finally:
        holder.cleanup()
        if spare is not None:
            spare.cleanup()


BIG_ROWS = 5_000_000  # indexing them takes seconds: far longer than the lease below


@pytest.mark.timeout(150)
def test_a_consumer_indexing_a_big_data_set_keeps_its_server_lease(tmp_path, redis_url, r,
                                                                   run_name, sim_factory):
    """A consumer opens and indexes its data set while its server lease must be renewed: were it
    not, the lease would lapse, a spare (here, this test) take the server, and the consumer
    stop itself (exit 3) before it ever drove the server."""
    data = tmp_path / "big.jsonl"
    data.write_bytes(b'{"prompt": "hi"}\n' * BIG_ROWS)
    producer = Background(redis_url, run_name, "produce", str(data), "--window", "8")
    try:
        wait_for(lambda: r.llen(RunKeys(run_name).rq_queue), timeout=90, what="tasks queued")
    finally:
        producer.cleanup()
    data.with_name(data.name + ".genq-idx").unlink()  # the producer's: the consumer builds it
    sim = sim_factory(**sim_kwargs(0.3, max_running_requests=4))
    c = Replica(redis_url, run_name, [sim.url], tmp_path / "out", "big", "--server-lease", "1")
    lease, grabbed, started = server_lease(identity(sim.url)), False, None
    try:
        wait_for(lambda: r.exists(lease) or not c.alive(), timeout=60,
                 what="the consumer taking its server")
        assert c.alive(), c.log()[-3000:]
        deadline = time.monotonic() + 90
        # A spare's move: take the server the moment its lease lapses, until the consumer has
        # driven it for two seconds.
        while not grabbed and c.alive() and time.monotonic() < deadline:
            if started is None and c.driving():
                started = time.monotonic()
            if started is not None and time.monotonic() - started > 2:
                break
            grabbed = bool(r.set(lease, "spare|x|1", nx=True, px=60_000))
            time.sleep(0.02)
        assert not grabbed, "the server lease lapsed while the consumer started up"
        assert started is not None, c.log()[-3000:]
        c.signal(signal.SIGTERM)
        assert c.wait(30) == 0, c.log()[-3000:]
    finally:
        c.cleanup()
        data.unlink()
