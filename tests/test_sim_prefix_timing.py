"""The simulator's prefill charges only the prompt tokens its prefix cache did not hold
(`--prefill-tps`): a prompt seen before reaches its first token sooner, whether or not the
server reports the hits (--enable-cache-report only changes what the answer says, as in SGLang).

Timings are compared as ratios with wide margins: a long prompt at a slow prefill rate costs
seconds, its cached repeat a small fraction of that, so load on the machine cannot blur them."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from genq.simulator.prefix import PAGE

pytest_plugins = ["sim_fixtures"]

PROMPT = list(range(1000, 1000 + 120 * PAGE))  # 1,920 prompt ids, all but one cacheable
SLOW = {"prefill_tps": 1000, "ttft": 0, "decode_tps": 1000, "length_dist": "fixed:2"}


def _first_token_s(url: str, ids: list[int], stream: bool) -> tuple[float, dict]:
    """Seconds until the answer's first token, and the answer's usage. A stream's first event
    waits for the first token (as SGLang's does); a whole answer of two tokens at 1,000/s
    comes within 2 ms of it."""
    body: dict = {"model": "m", "messages": [{"role": "user", "content": "x"}],
                  "input_ids": ids, "max_tokens": 2}
    started = time.monotonic()
    if not stream:
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()
        return time.monotonic() - started, answer["usage"]
    body.update(stream=True, stream_options={"include_usage": True})
    first, usage = 0.0, {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                first = first or time.monotonic() - started
                usage = json.loads(line[6:]).get("usage") or usage
    return first, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("report", [True, False], ids=["report", "no-report"])
def test_a_cached_prompt_skips_its_prefill(stream, report, sim_factory):
    sim = sim_factory(**SLOW, enable_cache_report=report)
    cold, cold_usage = _first_token_s(sim.url, PROMPT, stream)
    warm, warm_usage = _first_token_s(sim.url, PROMPT, stream)
    # 1,920 uncached tokens at 1,000/s: ~1.9 s; the repeat prefills one token: ~1 ms.
    assert cold > 1.5, cold
    assert warm < cold / 4, (cold, warm)
    details = warm_usage["prompt_tokens_details"]
    assert details == ({"cached_tokens": len(PROMPT) - 1} if report else None)
    assert cold_usage["prompt_tokens_details"] == ({"cached_tokens": 0} if report else None)


def test_a_shared_prefix_is_charged_only_for_what_follows_it(sim_factory):
    sim = sim_factory(**SLOW, enable_cache_report=True)
    _first_token_s(sim.url, PROMPT, False)
    # The same 1,920 ids, then 480 new ones: only those are prefilled (~0.5 s, not ~2.4 s).
    longer = PROMPT + list(range(50_000, 50_000 + 30 * PAGE))
    took, usage = _first_token_s(sim.url, longer, False)
    assert usage["prompt_tokens_details"] == {"cached_tokens": len(PROMPT)}
    assert 0.3 < took < 1.5, took
