"""Every turn of a `--turns all` conversation is written, then recorded: the last one too. A
consumer killed as it is about to write the conversation's last turn leaves Redis saying only
what its shard holds (the turns before it), so whoever claims it next makes that turn again."""

from __future__ import annotations

import orjson
import pytest
from conftest import genq
from faultkit import Consumer
from pipeline import read_jsonl
from test_conversations import conversation, write_rows

from genq.common.queue.keys import RunKeys


@pytest.mark.timeout(60)
def test_the_last_turn_is_on_disk_before_redis_records_how_the_conversation_ended(
        tmp_path, redis_url, r, run_name, sim_factory):
    row = conversation(0)  # two assistant turns, no tool call: turn 2 is the last
    data = write_rows(tmp_path / "one.jsonl", [row])
    sim = sim_factory(time_scale=200, tool_call_rate=0, length_dist="lognormal:20:0.3")
    genq("produce", str(data), "--once", "--turns", "all", "--max-tokens", "200",
         redis_url=redis_url, run=run_name)
    out = tmp_path / "out"
    c = Consumer(redis_url, run_name, sim.url, out, concurrency=1,
                 env={"GENQ_FAULT": "kill_before_write:2"})  # turn 1 written, then turn 2's
    try:
        assert c.wait(30) == -9, c.log()[-3000:]
    finally:
        c.cleanup()
    k = RunKeys(run_name)
    lines = [rec for shard in out.glob(f"{run_name}.*.jsonl") for rec in read_jsonl(shard)]
    assert [rec["turn"] for rec in lines] == [1]
    standing = orjson.loads(r.hget(k.conv, "0"))
    assert "end" not in standing and len(standing["made"]) == 1, standing
    assert r.execute_command("BITFIELD", k.conv_end, "GET", "u16", "#0") == [0]
    assert not r.getbit(k.done, 0)
