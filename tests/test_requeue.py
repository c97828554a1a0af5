"""`genq requeue` on live runs: the 8K pivot end to end, each --redo mode, --inflight finish,
and bad input that changes nothing."""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import orjson
import pytest
import redis
from conftest import genq
from faultproxy import FaultProxy
from pipeline import ConsumerProcess, wait_for, write_dataset
from pipeline import exported as export
from pipeline import status_json as status

from genq.common import params
from genq.common.queue.keys import RunKeys


def assert_status_matches(st: dict, records: list[dict]) -> None:
    assert st["done"] == len(records)
    assert st["finish_reasons"] == dict(Counter(r["finish_reason"] for r in records))
    lengths = sorted(r["completion_tokens"] for r in records)
    assert st["output_tokens"]["max"] == lengths[-1]
    assert st["output_tokens"]["mean"] == pytest.approx(sum(lengths) / len(lengths), rel=1e-3)


class LoadSampler(threading.Thread):
    """Samples each simulator's running requests, to see whether a GPU ever went idle."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(daemon=True)
        self.urls, self.samples, self.stop = urls, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self.stop.is_set():
                self.samples.append((time.monotonic(), *(
                    client.get(u + "/v1/loads").json()["loads"][0]["num_running_reqs"]
                    for u in self.urls)))
                time.sleep(0.01)

    def longest_idle(self) -> float:
        """The longest stretch of samples in which some simulator ran nothing, in seconds."""
        longest, since = 0.0, None
        for at, *running in self.samples:
            if min(running) == 0:
                since = at if since is None else since
                longest = max(longest, at - since)
            else:
                since = None
        return longest


@pytest.mark.slow  # a live run of 300 through a pivot
@pytest.mark.timeout(240)
def test_the_8k_pivot_on_a_live_run(tmp_path, redis_url, r, run_name, sim_factory):
    n, slots = 600, 8
    data = write_dataset(tmp_path / "data.jsonl", n)
    sims = [sim_factory(time_scale=100, max_running_requests=slots) for _ in range(2)]
    genq("produce", str(data), "--once", "--max-tokens", "4096", redis_url=redis_url,
         run=run_name)
    k = RunKeys(run_name)
    consumers = [ConsumerProcess(redis_url, run_name, s.url, tmp_path / f"o{i}", "--burst")
                 for i, s in enumerate(sims)]
    sampler = LoadSampler([s.url for s in sims])
    try:
        wait_for(lambda: r.bitcount(k.done) >= 150, timeout=60, what="150 done")
        sampler.start()
        time.sleep(0.5)
        before = status(redis_url, run_name)
        assert before["truncation_rate"] > 0.08  # about a fifth hit max_tokens 4096
        pivot = genq("requeue", "--set", "max_tokens=8192", "--redo", "truncated",
                     redis_url=redis_url, run=run_name)
        assert "parameters version 2: max_tokens 4096 -> 8192" in pivot.stdout
        time.sleep(1.5)
        sampler.stop.set()
        for c in consumers:
            assert c.wait(180) == 0, c.log()[-2000:]
    finally:
        sampler.stop.set()
        for c in consumers:
            c.cleanup()
    # The simulated GPUs never went idle across the switch: the requests an abort cancels
    # free the server at once, and their replacements follow within a few milliseconds.
    assert len(sampler.samples) > 20 and sampler.longest_idle() < 0.1, sampler.samples
    records = export(tmp_path, redis_url, run_name)
    assert sorted(rec["index"] for rec in records) == list(range(n))
    v1 = [rec for rec in records if rec["params_version"] == 1]
    v2 = [rec for rec in records if rec["params_version"] == 2]
    assert v1 and v2 and len(v1) + len(v2) == n
    assert all(rec["finish_reason"] == "stop" for rec in v1)  # truncated v1 results were redone
    assert Counter(rec["finish_reason"] for rec in v2)["stop"] > 0.8 * len(v2)
    assert max(rec["completion_tokens"] for rec in v2) > 4096
    st = status(redis_url, run_name)
    assert_status_matches(st, records)
    assert st["params_version"] == 2
    assert [h["version"] for h in st["params_history"]] == [1, 2]


@pytest.mark.timeout(120)
def test_redo_failed_and_redo_all(tmp_path, redis_url, r, run_name, sim_factory):
    n = 40
    data = write_dataset(tmp_path / "d.jsonl", n, poison=(3, 9))
    strict = sim_factory(time_scale=1000)  # answers the poison prompts with HTTP 400
    lenient = sim_factory(time_scale=1000, bad_marker="__nothing_matches__")
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    c = ConsumerProcess(redis_url, run_name, strict.url, tmp_path / "o", "--burst")
    assert c.wait(60) == 0
    c.cleanup()
    assert status(redis_url, run_name)["failed"] == 2
    out = genq("requeue", "--redo", "failed", redis_url=redis_url, run=run_name)
    assert "2 failed prompts" in out.stdout
    assert status(redis_url, run_name)["failed"] == 0
    c = ConsumerProcess(redis_url, run_name, lenient.url, tmp_path / "o", "--burst")
    assert c.wait(60) == 0
    c.cleanup()
    records = export(tmp_path, redis_url, run_name)
    # A redo makes a version of its own (same parameters), so its scope is exact.
    assert len(records) == n
    assert {rec["index"] for rec in records if rec["params_version"] == 2} == {3, 9}
    # Now everything again under a new temperature.
    out = genq("requeue", "--set", "temperature=0.1", "--redo", "all", redis_url=redis_url,
               run=run_name)
    assert f"queued again: {n} finished results" in out.stdout
    st = status(redis_url, run_name)
    assert st["done"] == 0 and st["finish_reasons"] == {}
    assert st["output_tokens"]["max"] in (0, None)
    c = ConsumerProcess(redis_url, run_name, lenient.url, tmp_path / "o", "--burst")
    assert c.wait(60) == 0
    c.cleanup()
    records = export(tmp_path, redis_url, run_name)
    assert len(records) == n and {rec["params_version"] for rec in records} == {3}
    assert_status_matches(status(redis_url, run_name), records)


@pytest.mark.timeout(120)
def test_inflight_finish_lets_old_requests_complete(tmp_path, redis_url, r, run_name,
                                                    sim_factory):
    data = write_dataset(tmp_path / "d.jsonl", 12)
    sim = sim_factory(time_scale=5, max_running_requests=4, length_dist="fixed:400")
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    k = RunKeys(run_name)
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "o", "--burst")
    try:
        wait_for(lambda: r.zcard(k.leases) >= 4, what="4 in flight (and one claimed ahead)")
        genq("requeue", "--set", "max_tokens=100", "--inflight", "finish",
             redis_url=redis_url, run=run_name)
        assert c.wait(60) == 0
        assert "aborted" not in c.log()
    finally:
        c.cleanup()
    records = export(tmp_path, redis_url, run_name)
    by_version = Counter(rec["params_version"] for rec in records)
    assert by_version[1] >= 4 and by_version[2] >= 1 and sum(by_version.values()) == 12
    assert all(rec["completion_tokens"] == 400 for rec in records if rec["params_version"] == 1)
    assert all(rec["completion_tokens"] == 100 for rec in records if rec["params_version"] == 2)


@pytest.mark.timeout(120)
def test_inflight_abort_requeues_without_spending_attempts(tmp_path, redis_url, r, run_name,
                                                           sim_factory):
    data = write_dataset(tmp_path / "d.jsonl", 8)
    # ~9 s requests: the requeue (a 1-2 s subprocess) lands while the first four are in flight,
    # not at a batch boundary where nothing is left to abort.
    sim = sim_factory(time_scale=5, max_running_requests=4, length_dist="fixed:4000")
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    k = RunKeys(run_name)
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "o", "--burst",
                        "--max-attempts", "1")
    try:
        wait_for(lambda: r.zcard(k.leases) >= 4, what="4 in flight (and one claimed ahead)")
        genq("requeue", "--set", "max_tokens=50", redis_url=redis_url, run=run_name)
        assert c.wait(60) == 0
    finally:
        c.cleanup()
    records = export(tmp_path, redis_url, run_name)
    assert len(records) == 8 and {rec["params_version"] for rec in records} == {2}
    assert all(rec["completion_tokens"] == 50 for rec in records)
    stats = httpx.get(sim.url + "/_sim/stats").json()
    assert stats["aborted"] >= 4  # the server saw the old requests cancelled


@pytest.mark.parametrize("args, message", [
    (["--set", "max_tokens=abc"], "max_tokens"),
    (["--set", "max_tokens=0"], "positive integer"),
    (["--set", "temperature=-1"], "temperature"),
    (["--set", "oops"], "KEY=VALUE"),
    ([], "nothing to change"),
    (["--redo", "sometimes"], "invalid choice"),
    # Consumers check token ids once, at start: a switch mid-run would write records without
    # them, and `export --format tokens` fails at the first one.
    (["--set", "return_token_ids=false"], "return_token_ids is read by consumers at start"),
    (["--set", "return_token_ids=true"], "return_token_ids is read by consumers at start"),
    (["--unset", "return_token_ids"], "return_token_ids is read by consumers at start"),
    # A run of one sample sends its seed as it is: past 2**31 no server's int seed holds it.
    (["--set", "seed=3000000000"], "seed must be an integer 0-2147483647"),
    (["--set", "seed=-1"], "seed must be an integer 0-2147483647"),
    # --raw keys that change what a request is, or how many answers it makes (one is kept).
    (["--raw", "n=4"], "--raw n=4: n makes the server decode 4 answers"),
    (["--raw", "input_ids=[1,2,3]"], "--raw input_ids=[1,2,3]: input_ids replaces"),
    (["--raw", "continue_final_message=true"], "continue_final_message"),
    (["--raw", "separate_reasoning=false"], "separate_reasoning"),
])
def test_bad_requeue_changes_nothing(tmp_path, redis_url, r, run_name, args, message):
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", 3)), "--once",
         redis_url=redis_url, run=run_name)
    proc = genq("requeue", *args, redis_url=redis_url, run=run_name, check=False)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr
    assert r.get(RunKeys(run_name).params_version) == b"1"


def test_requeue_unknown_run_and_unknown_key(tmp_path, redis_url, r, run_name):
    proc = genq("requeue", "--set", "max_tokens=8", redis_url=redis_url, run=run_name,
                check=False)
    assert proc.returncode != 0 and "unknown run" in proc.stderr
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", 3)), "--once",
         redis_url=redis_url, run=run_name)
    k = RunKeys(run_name)
    # A typo is refused with the known names, and makes no version.
    proc = genq("requeue", "--set", "max_token=8192", redis_url=redis_url, run=run_name,
                check=False)
    assert proc.returncode == 2 and "unknown parameter 'max_token'" in proc.stderr
    assert "max_tokens" in proc.stderr and "--raw max_token=VALUE" in proc.stderr
    assert r.get(k.params_version) == b"1"
    # --raw passes a server-specific one on purpose; --unset removes it again.
    genq("requeue", "--raw", "repetition_window=64", redis_url=redis_url, run=run_name)
    assert orjson.loads(r.hget(k.params, "2"))["repetition_window"] == 64
    out = genq("requeue", "--unset", "repetition_window", redis_url=redis_url, run=run_name)
    assert "repetition_window 64 -> None" in out.stdout
    assert "repetition_window" not in orjson.loads(r.hget(k.params, "3"))
    proc = genq("requeue", "--unset", "repetition_window", redis_url=redis_url, run=run_name,
                check=False)
    assert proc.returncode == 2 and "have no repetition_window" in proc.stderr
    # Setting a value the run already has is no change: no version, nothing aborted.
    proc = genq("requeue", "--set", "max_tokens=4096", redis_url=redis_url, run=run_name,
                check=False)
    assert proc.returncode == 2 and "already have these values" in proc.stderr
    assert r.get(k.params_version) == b"3"


def test_an_abort_switch_is_recorded_at_redis_time_when_it_happens(redis_server, r, run_name):
    """Redis refuses an older version's result written from an abort switch on, and `genq
    recover` applies the same rule to the switch's recorded time: so that time must be Redis's
    clock at the switch itself. Read one round trip before it, an ack landing in between was
    accepted by Redis and refused by a later recover. Here the switch goes over a slow link
    while the version and Redis's time are read together, again and again, on a fast one."""
    k = RunKeys(run_name)
    params.init_version_one(r, k, {"max_tokens": 100})
    proxy = FaultProxy(redis_server.port).start()
    proxy.delay = 0.05
    slow = redis.Redis.from_url(proxy.url())
    bumping = threading.Thread(target=params.bump, args=(slow, k, {"max_tokens": 200}),
                               kwargs={"redo": "none", "inflight": "abort"})
    seen: list[tuple[int, int]] = []  # (current version, Redis's time in µs), read atomically
    try:
        bumping.start()
        while bumping.is_alive():
            pipe = r.pipeline(transaction=True)
            pipe.get(k.params_version)
            pipe.time()
            version, (seconds, micros) = pipe.execute()
            seen.append((int(version or 1), seconds * 1_000_000 + micros))
            time.sleep(0.002)
        bumping.join()
    finally:
        slow.close()
        proxy.stop()
    assert int(r.get(k.params_version)) == 2
    at = round(orjson.loads(r.lindex(k.params_history, -1))["at"] * 1e6)
    before = [t for v, t in seen if v == 1]
    assert before and max(before) <= at, (
        f"version 1 still current {(max(before) - at) / 1e3:.1f} ms after the switch's time")
    assert all(t >= at for v, t in seen if v == 2)
