"""A consumer's housekeeping duties never wait on each other or on the server: with the
server's load and info endpoints frozen for 30 s (a server too busy to report), the heartbeat,
the parameter watch and the lease renewals keep their periods."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import genq
from faultkit import produce_once, sim_kwargs
from pipeline import ConsumerProcess, wait_for, write_dataset

from genq.common.queue.keys import RunKeys

NAME = "duty-test"
WATCH_S = 8.0


def gaps(times: list[float]) -> float:
    """The longest wait between two changes of a sampled value."""
    return max(b - a for a, b in zip(times, times[1:], strict=False))


@pytest.mark.slow  # a frozen endpoint, watched for its window
@pytest.mark.timeout(120)
def test_a_frozen_load_endpoint_stalls_no_other_duty(tmp_path, redis_url, r, run_name,
                                                      sim_factory):
    k = RunKeys(run_name)
    produce_once(write_dataset(tmp_path / "d.jsonl", 400), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(4.0, max_running_requests=8))
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "out", "--concurrency", "4",
                        "--visibility-timeout", "3", "--name", NAME)
    try:
        wait_for(lambda: r.zcard(k.leases) > 0 and r.zscore(k.consumers, NAME) is not None,
                 timeout=30, what="the consumer running tasks")
        httpx.post(sim.url + "/_sim/faults", json={"info_hang": True, "for_s": 30},
                   timeout=5).raise_for_status()
        frozen_at = time.monotonic()
        beats, renewals, last_beat, last_deadline = [frozen_at], [frozen_at], None, None
        requeued_at = None
        while time.monotonic() - frozen_at < WATCH_S:
            now = time.monotonic()
            beat = r.zscore(k.consumers, NAME)
            deadline = max((s for _, s in r.zrange(k.leases, 0, -1, withscores=True)),
                           default=None)
            if beat != last_beat:
                beats.append(now)
                last_beat = beat
            if deadline is not None and (last_deadline is None or deadline > last_deadline):
                renewals.append(now)
                last_deadline = deadline
            if requeued_at is None and now - frozen_at > 2:
                genq("requeue", "--set", "temperature=0.5", redis_url=redis_url, run=run_name)
                requeued_at = time.monotonic()
            time.sleep(0.1)
        beats.append(time.monotonic())
        renewals.append(time.monotonic())
        still_frozen = httpx.get(sim.url + "/_sim/faults", timeout=5).json()["info_hang_left_s"]
        assert still_frozen > 0, "the freeze must cover the whole watch"
        # Heartbeat every second, renewal every third of the 3 s visibility timeout.
        assert gaps(beats) < 2.5, f"heartbeat stalled: beats at {beats}"
        assert gaps(renewals) < 2.5, f"lease renewal stalled: renewals at {renewals}"
        changed = [e for e in c.events() if e.get("event") == "params_changed"]
        assert changed, "the parameter watch did not see the requeue while the server was frozen"
    finally:
        httpx.post(sim.url + "/_sim/faults", json={"info_hang": False}, timeout=5)
        c.kill()
