"""A schema's check of an answer runs beside the consumer's other duties, never in their way: a
pattern whose check takes seconds does not stop leases from being renewed."""

from __future__ import annotations

import json
import threading

import pytest
from conftest import genq
from pipeline import ConsumerProcess, read_jsonl, write_dataset

from genq.common.queue import scripts
from genq.common.queue.keys import RunKeys

WORDS = "alpha beta gamma delta epsilon zeta eta"
# Each pattern backtracks for seconds on its value (the simulator answers with an enum's value):
# the first in Python's re, the second in the regex module.
SLOW = {"type": "object", "required": ["words", "letters"], "properties": {
    "words": {"enum": [WORDS], "pattern": r"^(\w+\s?)*!$"},
    "letters": {"enum": ["a" * 40 + "b"], "pattern": r"^(a|aa)+$"}}}


@pytest.mark.slow  # lease renewals over a slow check
@pytest.mark.timeout(180)
def test_a_slow_pattern_does_not_cost_the_lease(tmp_path, redis_url, r, run_name, sim_factory):
    """Leases of one second, and a reaper (another consumer's duty, played here) that hands out
    again every lease not renewed in time: the prompt fails on the schema once, at its first
    attempt, its lease never lost."""
    schema = tmp_path / "slow.json"
    schema.write_text(json.dumps(SLOW))
    sim = sim_factory(time_scale=1000, length_dist="fixed:30")
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", 1)), "--once", "--schema",
         str(schema), "--set", "schema_retries=0", redis_url=redis_url, run=run_name)
    k, stop = RunKeys(run_name), threading.Event()
    runner = scripts.ScriptRunner(r)

    def reap() -> None:
        while not stop.wait(0.1):
            runner(scripts.reap_call(k, sweep_every_s=0))

    reaper = threading.Thread(target=reap, daemon=True)
    reaper.start()
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "out", "--burst",
                        "--visibility-timeout", "1")
    try:
        code = c.wait(120)
    finally:
        stop.set()
        reaper.join()
    events = [e.get("event") for e in c.events()]
    assert code == 0 and "lease_lost" not in events, c.log()[-3000:]
    out = tmp_path / "export.jsonl"
    genq("export", "--out", str(out), "--include-failed", redis_url=redis_url, run=run_name)
    [record] = read_jsonl(out)
    assert record["status"] == "failed" and record["attempt"] == 1
    assert record["error"].startswith("answer does not match the schema")
    c.cleanup()
