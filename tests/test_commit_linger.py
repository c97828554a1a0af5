"""consumer/commit.py against a paced server: answers that finish one by one still share
their write and ack (the linger), and an abort that comes before a request is sent ends it
as soon as it is sent (Inflight.sent)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import genq
from pipeline import ConsumerProcess, write_dataset

from genq.consumer.leases import Inflight, Lease


def evalsha_calls(r) -> int:
    return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


@pytest.mark.timeout(120)
def test_a_paced_server_shares_script_calls_among_answers(tmp_path, redis_url, r, run_name,
                                                            sim_factory):
    """~150 answers a second, each finishing on its own: without the linger (LINGER_S = 0) this
    run made 542 script calls for its 400 tasks, with it 253."""
    n = 400
    data = write_dataset(tmp_path / "data.jsonl", n)
    # 32 slots x ~0.2 s (a median of 16 tokens at 80 tokens/s, each its own length, so that
    # answers come one by one): ~150 requests a second.
    sim = sim_factory(time_scale=1, ttft=0, length_dist="lognormal:16:0.5", decode_tps=80,
                      max_running_requests=32)
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    before = evalsha_calls(r)
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "out", "--burst")
    try:
        assert c.wait(90) == 0, c.log()[-2000:]
    finally:
        c.cleanup()
    calls = evalsha_calls(r) - before
    lines = sum(p.read_bytes().count(b"\n") for p in (tmp_path / "out").glob("*.jsonl"))
    assert lines == n and r.bitcount(f"genq:{run_name}:done") == n
    # Claims (~4 a call), acks (~7 a call), a reap a second.
    assert calls < 0.8 * n, f"{calls} script calls for {n} tasks"


def test_an_abort_before_the_request_is_sent_ends_it_once_sent():
    lease = Lease(job_id="j-1", index=1, exec_id="e", attempt=1, spent=1, version=1)

    async def main() -> tuple[bool, bool]:
        waiting = Inflight(lease)
        waiting.abort = "parameters changed to version 2"  # what Inflight.cancel sets
        request = asyncio.ensure_future(asyncio.sleep(10))
        waiting.sent(request)  # SGLang.chat's on_request
        await asyncio.gather(request, return_exceptions=True)
        untouched = Inflight(lease)
        other = asyncio.ensure_future(asyncio.sleep(0.01))
        untouched.sent(other)
        await other
        return request.cancelled(), other.cancelled()

    assert asyncio.run(main()) == (True, False)
