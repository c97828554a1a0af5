"""Real tier: `requeue --redo truncated --continue` by token ids against a real SGLang 0.5.23
(tests/test_continue_ids.py covers the simulator). Greedy answers (temperature 0) cut at a
small max_tokens, continued at a larger one with the consumer's normal concurrency: each
continued answer's ids start with its partial's, and the share equal to the straight greedy
answer at the larger limit is measured and printed; where the ids are equal the text and its
thinking split are too.

The tier's tiny random model has `<think>`/`</think>` as special tokens and never thinks on
its own, so the run asks what makes the tags matter as on a Qwen3 server: the tags kept in
the text (`skip_special_tokens: false`, as Qwen3's are plain text) and a small `logit_bias`
toward `</think>`, which greedy decoding then writes at a varying position (cuts fall inside
the thinking and after `</think>`); `ignore_eos` keeps every answer going to its limit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import genq
from faultkit import record_figures
from pipeline import ConsumerProcess, read_jsonl, write_dataset
from sglang_servers import start_server

pytestmark = pytest.mark.real_sglang
N, SMALL, LARGE = 32, 40, 100
# Greedy decoding then writes `</think>` in most answers, first somewhere in 10..60.
THINK_END_BIAS = 0.3


def think_end_id() -> int:
    base = Path(os.environ.get("BASE") or Path.home() / ".cache" / "genq-real-sglang")
    added = json.loads((base / "tiny-model" / "tokenizer.json").read_text())["added_tokens"]
    return next(t["id"] for t in added if t["content"] == "</think>")


def test_continued_by_ids_on_real_sglang(tmp_path, redis_url, run_name):
    close = think_end_id()
    raw = ("--raw", "ignore_eos=true", "--raw", "skip_special_tokens=false",
           "--raw", "logit_bias=" + json.dumps({str(close): THINK_END_BIAS}))
    data = write_dataset(tmp_path / "d.jsonl", N)
    runs = {"cont": run_name, "straight": run_name + "-straight"}

    def run(name: str, *flags: str) -> None:
        c = ConsumerProcess(redis_url, name, server.url, tmp_path / name, "--burst",
                            "--server-wait", "300", *flags)
        try:
            assert c.wait(900) == 0, c.log()[-3000:]
        finally:
            c.cleanup()

    def export(name: str) -> dict[int, dict]:
        out = tmp_path / f"{name}.jsonl"
        genq("export", "--out", str(out), redis_url=redis_url, run=name)
        return {rec["index"]: rec for rec in read_jsonl(out)}

    server = start_server("real", "tuned")
    try:
        for name, limit in ((runs["cont"], SMALL), (runs["straight"], LARGE)):
            genq("produce", str(data), "--once", "--token-ids", "--max-tokens", str(limit),
                 "--temperature", "0", *raw, redis_url=redis_url, run=name)
        # The reference: each greedy answer at the larger limit, one request at a time.
        run(runs["straight"], "--concurrency", "1")
        run(runs["cont"])  # the server's 16 at once, as a consumer runs
        first = export(runs["cont"])
        assert all(rec["finish_reason"] == "length" for rec in first.values())
        out = genq("requeue", "--set", f"max_tokens={LARGE}", "--redo", "truncated",
                   "--continue", redis_url=redis_url, run=runs["cont"]).stdout
        assert f"partials kept for --continue: {N}" in out
        run(runs["cont"])  # the continuations, 16 at once
        cont, straight = export(runs["cont"]), export(runs["straight"])
    finally:
        server.close()

    equal, partial_equal, cases = 0, 0, {"inside": 0, "after": 0}
    for i, old in first.items():
        new, want = cont[i], straight[i]
        ids = new["completion_token_ids"]
        assert ids[:SMALL] == old["completion_token_ids"]
        assert new["continued_from"]["tokens"] == SMALL
        assert new["completion_tokens"] == len(ids) == LARGE
        assert new["prompt_token_ids"] == old["prompt_token_ids"] == want["prompt_token_ids"]
        partial_equal += old["completion_token_ids"] == want["completion_token_ids"][:SMALL]
        if ids == want["completion_token_ids"]:
            equal += 1
            assert (new["reasoning_content"], new["content"]) == (
                want["reasoning_content"], want["content"]), i
            cases["after" if close in old["completion_token_ids"] else "inside"] += 1
    share = equal / N
    print(f"\ncontinued by ids, {N} greedy answers cut at {SMALL}, continued to {LARGE}, "
          f"16 at once: {equal}/{N} = {share:.0%} equal to the straight answer "
          f"(one at a time); partials equal to its first {SMALL}: {partial_equal}/{N}; "
          f"equal ones cut inside the thinking {cases['inside']}, after </think> "
          f"{cases['after']}")
    record_figures("continue_ids_real", answers=N, equal_to_straight=equal,
                   partials_equal=partial_equal, **cases)
    assert cases["inside"] and cases["after"]
    assert share >= 0.9
