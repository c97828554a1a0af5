"""`genq requeue --dry-run` and the summary every requeue prints: the diff, what each redo scope
touches, the requests in flight that are aborted, and the extra tokens and time it costs."""

from __future__ import annotations

import pytest
from conftest import ack_call, genq
from pipeline import write_dataset

from genq.common.queue import scripts
from genq.common.queue.keys import RunKeys
from genq.producer.requeue import extra_tokens


def test_extra_tokens():
    # 10 truncated at 4096 redone with 8192: at least 4096 each, at most 8192 each.
    assert extra_tokens(redo="truncated", results=10, failed=0, aborted=0, mean=1000,
                        ctok_sum=0, old_max=4096, new_max=8192) == (40960, 81920)
    # all: about what the run generated so far; failed and aborted: a mean result each.
    assert extra_tokens(redo="all", results=5, failed=2, aborted=3, mean=100, ctok_sum=700,
                        old_max=4096, new_max=4096) == (1200, 1200)
    assert extra_tokens(redo="none", results=0, failed=0, aborted=4, mean=50.4, ctok_sum=9,
                        old_max=1, new_max=2) == (202, 202)


@pytest.fixture
def live_run(tmp_path, redis_url, r, run_name):
    """20 prompts: 12 done (4 of them truncated at max_tokens 4096), 3 in flight, 5 queued;
    moved through the real queue scripts."""
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", 20)), "--once",
         redis_url=redis_url, run=run_name)
    k, run = RunKeys(run_name), scripts.ScriptRunner(r)
    _, *rows = run(scripts.claim_call(k, 15, 600, "http://s", "w", "e"))
    for n, (jid, idx, ex, attempt, *_) in enumerate(rows[:12]):
        truncated = n < 4
        run(ack_call(k, jid.decode(), int(idx), ex.decode(),
                     completion_tokens=4096 if truncated else 1000, prompt_tokens=5,
                     finish_reason="length" if truncated else "stop", version=1,
                     attempt=int(attempt), server="http://s"))
    return k


def test_dry_run_says_what_would_change_and_changes_nothing(live_run, redis_url, r, run_name):
    k = live_run
    out = genq("requeue", "--set", "max_tokens=8192", "--redo", "truncated", "--dry-run",
               redis_url=redis_url, run=run_name).stdout
    assert out.startswith("dry run, nothing changed:")
    assert "parameters version 2: max_tokens 4096 -> 8192" in out
    assert "redo truncated: 4 finished results" in out
    assert "in flight: 3 requests under older parameters are aborted" in out
    # 4 redone at 4096..8192 each, 3 aborted at the mean (1998.2) each.
    assert "about 22k–39k extra output tokens" in out
    # The time needs a rate, which needs a second of history since the run began.
    assert "at the current" in out or "no current rate" in out
    assert r.get(k.params_version) == b"1" and r.llen(k.params_history) == 1
    assert r.bitcount(k.done) == 12 and r.zcard(k.leases) == 3


def test_every_requeue_prints_the_summary_after_acting(live_run, redis_url, r, run_name):
    k = live_run
    out = genq("requeue", "--redo", "all", redis_url=redis_url, run=run_name).stdout
    assert "parameters version 2: no parameter changes" in out
    assert "redo all: 12 finished results" in out and "redo failed: 0 failed prompts" in out
    # A redo alone lets requests in flight finish: same parameters, nothing to throw away.
    assert "in flight: requests under older parameters finish and are kept" in out
    assert "queued again: 12 finished results (all), 0 failed prompts" in out
    assert r.bitcount(k.done) == 0 and r.zcard(k.leases) == 3
    assert r.get(k.params_version) == b"2"


def test_render_turns_tokens_into_time_at_the_current_rate():
    from genq.producer.requeue import Plan, render
    plan = Plan(run="r", version=1, new_version=2, diff={"max_tokens": [4096, 8192]},
                new_params={}, redo="truncated", inflight="finish", results=1710, failed=0,
                aborted=0, tokens=(7_004_160, 14_008_320), tok_per_s=24310.0)
    lines = render(plan)
    assert lines[0] == "run 'r': parameters version 2: max_tokens 4096 -> 8192"
    assert lines[-1] == ("cost: about 7.0M–14.0M extra output tokens, 4m 48s–9m 36s at the "
                         "current 24,310 tok/s")
