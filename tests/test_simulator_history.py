"""The simulator renders a conversation's history as Qwen3's chat template does: an assistant
turn's reasoning stays in the prompt after the last user query (inside the tool chain being
worked through) and is dropped before it; its calls follow its content. So a made turn inside a
tool chain is rendered as the ids it was made of."""

from __future__ import annotations

import httpx
import pytest
from test_simulator import FAST

from genq.simulator import model, toolcalls
from genq.simulator.tokens import encode, render

pytest_plugins = ["sim_fixtures"]

CALL = [{"id": "call_1", "type": "function",
         "function": {"name": "read_file", "arguments": "{\"path\": \"a.py\"}"}}]
CONVERSATION = [
    {"role": "user", "content": "First question."},
    {"role": "assistant", "reasoning_content": "oldthought", "content": "First answer."},
    {"role": "user", "content": "Now read a.py."},
    {"role": "assistant", "reasoning_content": "chainthought", "content": "Reading.",
     "tool_calls": CALL},
    {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"},
    {"role": "user", "content": "<tool_response>\nprint(2)\n</tool_response>"},
    {"role": "assistant", "content": "<think>\ninlinethought\n</think>\n\nLooked."},
    {"role": "tool", "tool_call_id": "call_1", "content": "print(3)"},
]


def _holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[at:at + len(part)] == part for at in range(len(ids) - len(part) + 1))


def _prompt_ids(url: str, messages: list[dict]) -> list[int]:
    body = {"model": "m", "messages": messages, "max_tokens": 4, "return_token_ids": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
    return r.json()["choices"][0]["prompt_token_ids"]


def test_reasoning_is_kept_after_the_last_user_query_and_dropped_before(sim_factory):
    sim = sim_factory(**FAST)
    ids = _prompt_ids(sim.url, CONVERSATION)
    # Before the last query: the answer only, its reasoning gone.
    assert _holds(ids, encode("assistant\nFirst answer.")) and not _holds(ids, encode("oldthought"))
    # After it (a user message that is only a tool response does not count as a query): both
    # reasoning_content and thinking written inside content are rendered in <think>.
    assert _holds(ids, encode("assistant\n<think>\nchainthought\n</think>\n\nReading.\n<tool_call>"
                              '\n{"name": "read_file", "arguments": {"path": "a.py"}}\n'
                              "</tool_call><|im_end|>"))
    assert _holds(ids, encode("assistant\n<think>\ninlinethought\n</think>\n\nLooked."))
    # A new user query moves the line: the chain's reasoning now lies before it.
    later = _prompt_ids(sim.url, [*CONVERSATION, {"role": "user", "content": "Thanks."}])
    assert not _holds(later, encode("chainthought")) and not _holds(later, encode("inlinethought"))
    assert _holds(later, encode("assistant\nLooked."))


@pytest.mark.parametrize("parser", [True, False])
def test_a_made_turn_with_a_call_renders_as_its_own_ids(parser):
    """Every length whose thinking holds a word between `<think>\\n` and `\\n</think>`: the
    answer's ids, split as the chat answer is (reasoning parser or not, then the call parser),
    are where the next prompt in the chain begins."""
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    head = [{"role": "user", "content": "Read it."}]
    prompt = render(head, tools, thinking=True)
    call = tuple(encode(toolcalls.call_text("read_file", {"words": 2}), answer=True))
    for natural in range(8, 80):
        done = model.complete(natural, natural + 20, True, call=call)
        raw = model.texts(done, parser=False)[1]
        reasoning, content = model.parsed(raw, True) if parser else (None, raw)
        normal, calls = toolcalls.parse(content, tools)
        made = {"role": "assistant", "content": normal, "reasoning_content": reasoning,
                "tool_calls": toolcalls.openai(calls)}
        after = render([*head, made, {"role": "tool", "content": "x"}], tools, thinking=True)
        assert after[:len(prompt) + done.tokens] == prompt + done.ids(), natural


def test_tool_answers_render_as_qwen3s_user_turn_of_tool_responses(sim_factory):
    """Qwen3's template writes a tool message as a <tool_response> inside a user turn, the tool
    messages in a row sharing one turn: what the regenerated turn after a call is asked with."""
    sim = sim_factory(**FAST)
    two = [{"role": "user", "content": "Read both."},
           {"role": "assistant", "content": "", "tool_calls": CALL + CALL},
           {"role": "tool", "tool_call_id": "call_1", "content": "A"},
           {"role": "tool", "tool_call_id": "call_1", "content": "B"}]
    ids = _prompt_ids(sim.url, two)
    assert _holds(ids, encode("</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nA\n"
                              "</tool_response>\n<tool_response>\nB\n</tool_response><|im_end|>"
                              "\n<|im_start|>assistant\n"))
    assert not _holds(ids, encode("<|im_start|>tool"))
