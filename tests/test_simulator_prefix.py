"""The simulator's prefix cache: what an earlier request left is reported as cached prompt
tokens, in SGLang's shape, and only with --enable-cache-report on chat answers."""

from __future__ import annotations

import httpx
from test_simulator import FAST, chat

from genq.simulator.prefix import PAGE, PrefixCache

pytest_plugins = ["sim_fixtures"]


def _ids_chat(url: str, ids: list[int]) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "input_ids": ids,
            "max_tokens": 20}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=10).json()


def _all_but_last(ids: list[int]) -> int:
    """A whole prompt seen before: its full pages, less the last token, which starts the
    answer and is always computed."""
    return min(len(ids) // PAGE * PAGE, len(ids) - 1)


def test_a_next_turn_finds_the_last_turns_prompt_and_answer_cached(sim_factory):
    sim = sim_factory(**FAST, enable_cache_report=True)
    first = chat(sim.url, "a question long enough to fill some pages " * 4,
                 return_token_ids=True).json()
    # Nothing cached yet: SGLang 0.5.23 with the flag says 0 (null is only without the flag).
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    choice = first["choices"][0]
    held = choice["prompt_token_ids"] + choice["response_token_ids"]
    follow = held + [7] * 40  # the next turn: all of it, then new messages
    second = _ids_chat(sim.url, follow)
    assert second["usage"]["prompt_tokens"] == len(follow)
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": len(held) // PAGE * PAGE}
    # The same prompt again: all of it but the last token, which starts the answer.
    again = _ids_chat(sim.url, follow)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert again == _all_but_last(follow)


def test_without_the_flag_chat_reports_null_and_generate_still_counts(sim_factory):
    sim = sim_factory(**FAST)
    ids = list(range(3, 3 + 5 * PAGE))
    assert _ids_chat(sim.url, ids)["usage"]["prompt_tokens_details"] is None
    assert _ids_chat(sim.url, ids)["usage"]["prompt_tokens_details"] is None
    # SGLang's native /generate always says cached_tokens in meta_info, and where they were
    # kept (0.5.23: on the GPU, "device"; null on a miss).
    meta = httpx.post(sim.url + "/generate", json={"input_ids": ids}, timeout=10).json()
    assert meta["meta_info"]["cached_tokens"] == _all_but_last(ids)
    assert meta["meta_info"]["cached_tokens_details"] == {"device": _all_but_last(ids),
                                                           "host": 0}
    miss = httpx.post(sim.url + "/generate", json={"input_ids": [9] * 40}, timeout=10).json()
    assert (miss["meta_info"]["cached_tokens"], miss["meta_info"]["cached_tokens_details"]) == (
        0, None)


def test_the_cache_forgets_the_least_recently_used_beyond_its_capacity():
    cache = PrefixCache(capacity=4 * PAGE)
    a, b = list(range(2 * PAGE + 1)), list(range(1000, 1000 + 2 * PAGE + 1))
    assert cache.take(a, []) == 0 and cache.take(b, []) == 0
    assert cache.take(a, []) == 2 * PAGE  # a used again: b is now the oldest
    cache.take(list(range(5000, 5000 + 2 * PAGE)), [])  # two more pages push b out
    assert cache.take(b, []) == 0 and cache.take(a, []) == 0  # b came back, pushing a out
