"""The truncation alert judges only results under the current parameters: right after
`--set max_tokens=8192 --redo truncated` the old 4096 hits are not hits at 8192."""

from __future__ import annotations

import orjson
from conftest import ack_call, genq
from pipeline import write_dataset

from genq.common.queue import scripts
from genq.common.queue.keys import RunKeys


def ack_claimed(r, k: RunKeys, n: int, finish: str, tokens: int) -> None:
    run = scripts.ScriptRunner(r)
    version, *rows = run(scripts.claim_call(k, n, 600, "http://s", "w", "e"))
    for jid, idx, ex, attempt, *_ in rows:
        assert run(ack_call(k, jid.decode(), int(idx), ex.decode(),
                            completion_tokens=tokens, prompt_tokens=5,
                            finish_reason=finish, version=int(version),
                            attempt=int(attempt), server="http://s")) == [1]


def truncation_alerts(redis_url: str, run: str) -> list[dict]:
    st = orjson.loads(genq("status", "--json", redis_url=redis_url, run=run).stdout)
    return [a for a in st["alerts"] if a["kind"] == "truncation"]


def test_alert_counts_only_current_version_results(tmp_path, redis_url, r, run_name):
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", 120)), "--once",
         "--max-tokens", "4096", redis_url=redis_url, run=run_name)
    k = RunKeys(run_name)
    ack_claimed(r, k, 30, "length", 4096)
    [alert] = truncation_alerts(redis_url, run_name)
    assert "max_tokens=4096" in alert["message"] and "max_tokens=8192" in alert["command"]
    genq("requeue", "--set", "max_tokens=8192", "--redo", "truncated", redis_url=redis_url,
         run=run_name)
    assert truncation_alerts(redis_url, run_name) == []  # not "100 % hit 8192: use 16384"
    ack_claimed(r, k, 25, "stop", 5000)
    assert truncation_alerts(redis_url, run_name) == []
    ack_claimed(r, k, 25, "length", 8192)  # now half of v2's results hit the new limit
    [alert] = truncation_alerts(redis_url, run_name)
    # The version's own rate speaks now (the page's "is 8k enough?"), with its interval.
    assert alert["message"].startswith("50% (95% CI")
    assert "under v2 (max_tokens=8192)" in alert["message"]
    assert alert["command"].startswith("genq requeue --set max_tokens=16384 --redo truncated")
