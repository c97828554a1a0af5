"""Recovering exactly (issue: recover handed attempt numbers out again, and the export then
silently picked a refused result). A recover starts a new generation of the run, carried by
every line claimed after it, so a consumer that slept through the loss (its claims made before
it) writes lines the export can tell apart; recover refuses a partial set of output directories
unless told; and two different lines under the key Redis accepted make the export refuse."""

from __future__ import annotations

import signal
import time

import orjson
import pytest
from conftest import genq
from faultkit import (
    Background,
    Consumer,
    bits,
    check_truth,
    private_redis,
    record_figures,
    sim_kwargs,
)
from pipeline import ConsumerProcess, read_jsonl, wait_for, write_dataset
from test_recover import lose_redis

from genq.common.queue.keys import PER_INDEX_BITS, RunKeys


def lines_of(dirs, run: str) -> list[dict]:
    return [rec for d in dirs for p in d.glob(f"{run}.*.jsonl") for rec in read_jsonl(p)]


@pytest.mark.slow  # a Redis loss and recover
@pytest.mark.timeout(300)
def test_a_consumer_frozen_across_a_loss_and_recover_never_passes_off_a_refused_result(
        tmp_path, run_name, sim_factory):
    n = 400
    data = write_dataset(tmp_path / "d.jsonl", n)
    sims = [sim_factory(**sim_kwargs(1.5)) for _ in range(2)]
    dirs = [tmp_path / "frozen", tmp_path / "awake"]
    k = RunKeys(run_name)
    with private_redis() as redis_srv:
        url, r = redis_srv.url, redis_srv.client()
        producer = Background(url, run_name, "produce", str(data), "--max-tokens", "300")
        wait_for(lambda: r.exists(k.meta), what="the run registered")
        frozen, awake = (ConsumerProcess(url, run_name, sim.url, d, "--burst")  # defaults
                         for sim, d in zip(sims, dirs, strict=True))
        try:
            wait_for(lambda: r.bitcount(k.done) >= 40, timeout=90, what="40 done")
            frozen.signal(signal.SIGSTOP)  # mid-request: a VM pause, a partition
            lose_redis(redis_srv)  # no AOF: it comes back empty
            r = redis_srv.client()
            wait_for(lambda: "run_state_lost" in awake.log(), timeout=30, what="the loss seen")
            out = genq("recover", "--shards", *map(str, dirs), redis_url=url, run=run_name)
            assert "recovered run" in out.stdout
            wait_for(lambda: r.bitcount(k.done) >= 80, timeout=90, what="work after the recover")
            frozen.signal(signal.SIGCONT)  # wakes with claims of the run before the recover
            assert frozen.wait(240) == 0, frozen.log()[-4000:]
            assert awake.wait(240) == 0, awake.log()[-4000:]
            assert "run_recovered_unseen" in frozen.log()
            assert producer.stop() == 0
        finally:
            for service in (frozen, awake, producer):
                service.cleanup()
        # Status and export agree result for result (counters, token sums, histogram).
        figures = check_truth(r, url, run_name, n, tmp_path)
        records = read_jsonl(tmp_path / f"export-{run_name}.jsonl")
    # The hole, seen: attempts claimed before the loss and again after it, told apart by gen.
    keys: dict[tuple, set[int]] = {}
    for rec in lines_of(dirs, run_name):
        keys.setdefault((rec["index"], rec["params_version"], rec["attempt"]), set()).add(
            rec.get("gen", 0))
    shared = sum(len(gens) > 1 for gens in keys.values())
    record_figures("frozen_consumer_across_recover", attempts_shared_across_generations=shared,
                   **figures)
    assert figures["done"] == n and {rec.get("gen", 0) for rec in records} == {0, 1}


@pytest.mark.slow  # a loss and recover
@pytest.mark.timeout(240)
def test_recover_refuses_a_partial_set_of_directories_and_a_partial_one_then_exports_exactly(
        tmp_path, run_name, sim_factory):
    n = 200
    data = write_dataset(tmp_path / "d.jsonl", n)
    sims = [sim_factory(**sim_kwargs(0.3)) for _ in range(2)]
    dirs = [tmp_path / "a", tmp_path / "b"]
    k = RunKeys(run_name)
    with private_redis() as redis_srv:
        url, r = redis_srv.url, redis_srv.client()
        genq("produce", str(data), "--once", "--max-tokens", "300", redis_url=url, run=run_name)
        consumers = [ConsumerProcess(url, run_name, sim.url, d, "--burst")
                     for sim, d in zip(sims, dirs, strict=True)]
        try:
            wait_for(lambda: r.bitcount(k.done) >= 80, timeout=90, what="80 done")
            wait_for(lambda: all(len(lines_of([d], run_name)) for d in dirs), what="both wrote")
            lose_redis(redis_srv)  # no AOF: it comes back empty
            r = redis_srv.client()
            for c in consumers:
                wait_for(lambda c=c: "run_state_lost" in c.log(), timeout=30, what="loss seen")
            # Given only one directory (what a single consumer's log used to print): refused,
            # naming the one left out and the whole command.
            refused = genq("recover", "--shards", str(dirs[0]), redis_url=url, run=run_name,
                           check=False)
            assert refused.returncode == 2 and str(dirs[1]) in refused.stderr
            assert f"--shards {dirs[0]} {dirs[1]}" in refused.stderr
            assert not r.exists(k.meta)
            # Told to go on: b's results run again, under the new generation.
            genq("recover", "--shards", str(dirs[0]), "--partial", redis_url=url, run=run_name)
            # Each per-index field at its final size, as a new run's (no 1.6x growth later).
            assert {name: r.strlen(getattr(k, name)) for name in PER_INDEX_BITS} == {
                name: (n * bits + 7) // 8 for name, bits in PER_INDEX_BITS.items()}
            for c in consumers:
                assert c.wait(180) == 0, c.log()[-4000:]
        finally:
            for c in consumers:
                c.cleanup()
        # The export reads both directories (the consumers registered them): b's lines made
        # before the loss share attempt numbers with the new ones, and never stand in for them.
        check_truth(r, url, run_name, n, tmp_path)


def test_two_different_lines_under_the_accepted_key_make_the_export_refuse(
        tmp_path, redis_url, r, run_name, sim_factory):
    data = write_dataset(tmp_path / "d.jsonl", 20)
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    out = tmp_path / "out"
    c = ConsumerProcess(redis_url, run_name, sim_factory(time_scale=1000).url, out, "--burst")
    assert c.wait(60) == 0, c.log()[-3000:]
    c.cleanup()
    raw = [line for p in out.glob(f"{run_name}.*.jsonl") for line in p.read_bytes().splitlines()]
    seven = next(line for line in raw if orjson.loads(line)["index"] == 7)
    three = next(line for line in raw if orjson.loads(line)["index"] == 3)
    forged = orjson.dumps({**orjson.loads(seven), "content": "not what was accepted"})
    (out / f"{run_name}.other.000001.jsonl").write_bytes(forged + b"\n")
    (out / f"{run_name}.copy.000001.jsonl").write_bytes(three + b"\n")  # a copy: no doubt
    target = tmp_path / "x.jsonl"
    refused = genq("export", "--out", str(target), redis_url=redis_url, run=run_name,
                   check=False)
    assert refused.returncode != 0 and "indices [7]" in refused.stderr
    assert not target.exists()
    genq("export", "--out", str(target), "--allow-ambiguous", redis_url=redis_url, run=run_name)
    records = read_jsonl(target)
    assert [rec["index"] for rec in records] == list(range(20))


def accepted_keys(r, k: RunKeys, total: int) -> dict[int, tuple[int, int]]:
    """Every done index's accepted (params_version, attempt), as Redis holds them."""
    done = bits(r.get(k.done), total)
    version, attempt = ((r.get(key) or b"").ljust(2 * total, b"\0")
                        for key in (k.acc_version, k.acc_attempt))
    return {i: (int.from_bytes(version[2 * i:2 * i + 2], "big"),
                int.from_bytes(attempt[2 * i:2 * i + 2], "big")) for i in done}


@pytest.mark.slow  # a consumer's clock 90 s behind, through a requeue and a loss
@pytest.mark.timeout(240)
def test_recover_judges_results_by_redis_clock_not_a_skewed_consumers(
        tmp_path, run_name, sim_factory):
    # A consumer whose clock is 90 s behind writes through an `--inflight abort` switch: Redis
    # refuses its older-version results written after it. The recover must make exactly the
    # decisions Redis made, result for result.
    n = 200
    data = write_dataset(tmp_path / "d.jsonl", n)
    sim = sim_factory(**sim_kwargs(0.5))
    out, k = tmp_path / "out", RunKeys(run_name)
    with private_redis() as redis_srv:
        url, r = redis_srv.url, redis_srv.client()
        genq("produce", str(data), "--once", "--max-tokens", "300", redis_url=url, run=run_name)
        # Leases outlast the pause below, so every refusal is the switch's, not a lost lease's.
        c = Consumer(url, run_name, sim.url, out, "--burst", concurrency=8, vt=10.0,
                     prefix=("faketime", "-m", "-f", "-90s"))
        try:
            wait_for(lambda: r.bitcount(k.done) >= 30, timeout=90, what="30 done")
            # Paused while its requests end at the server and the switch is made: once resumed,
            # it reads answers already there before its next look at the parameters (a race
            # otherwise: 2 runs in 6 wrote none in the window on a busy machine).
            c.signal(signal.SIGSTOP)
            time.sleep(1.0)  # requests take about 0.5 s
            genq("requeue", "--set", "max_tokens=400", redis_url=url, run=run_name)  # aborts
            c.signal(signal.SIGCONT)
            # Stopped as soon as Redis refused an older result written after the switch, before
            # its prompt runs again: recovery must not let that line stand.
            wait_for(lambda: "result_superseded" in c.log(), timeout=30, interval=0.01,
                     what="an older result refused")
            c.signal(signal.SIGSTOP)
            time.sleep(0.5)  # acks in flight land
            want = accepted_keys(r, k, n)
            r.flushall()
            genq("recover", "--shards", str(out), redis_url=url, run=run_name)
            got = accepted_keys(r, k, n)
            c.signal(signal.SIGCONT)
            assert c.wait(180) == 0, c.log()[-4000:]
        finally:
            c.cleanup()
        check_truth(r, url, run_name, n, tmp_path)
    assert 1 in {v for v, _ in want.values()}  # results before the switch stand
    assert {i: got.get(i) for i in want} == want
    # More may stand: written, their acks stopped with the consumer; never an older version
    # written after the switch (Redis refused those).
    assert all(got[i][0] == 2 for i in set(got) - set(want))
