"""The simulator's token-id surface, as SGLang 0.5.23's: `return_token_ids`, chat and
`/generate` `input_ids`, and continuing an answer from its ids or its text."""

from __future__ import annotations

import httpx
import pytest
from sim_fixtures import SimProcess, sim_flags

PROMPT = [{"role": "user", "content": "count the queues"}]
# 200 ids: <think> at 0, </think> at 139, the blank line at 140, the answer, <|im_end|> at 199.
FLAGS = {"time_scale": 1000, "length_dist": "fixed:200", "reasoning_parser": "qwen3"}


def post(url: str, path: str, **body) -> dict:
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def chat(url: str, **body) -> dict:
    return post(url, "/v1/chat/completions", **{"messages": PROMPT, **body})


@pytest.fixture(scope="module")
def sim():
    # One simulator for the module: every test reads its own prompts' answers.
    process = SimProcess(*sim_flags(**FLAGS)).start()
    yield process
    process.cleanup()


def straight(sim, max_tokens: int = 500) -> dict:
    return chat(sim.url, max_tokens=max_tokens, return_token_ids=True)["choices"][0]


def test_a_whole_answer_carries_its_prompt_and_response_ids(sim):
    choice = straight(sim)
    prompt, response = choice["prompt_token_ids"], choice["response_token_ids"]
    assert len(response) == 200 and response[0] == 151667 and response[-1] == 151645
    assert response[139] == 151668  # </think>
    answer = chat(sim.url, max_tokens=500, return_token_ids=True)
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert answer["usage"]["completion_tokens"] == len(response)
    assert "prompt_token_ids" not in chat(sim.url, max_tokens=5)["choices"][0]


@pytest.mark.parametrize("k", [1, 60, 139, 140, 141, 170])
def test_continuing_from_the_first_k_ids_gives_the_rest_of_the_straight_answer(sim, k):
    """k inside the thinking, at </think>, at the blank line after it, in the answer."""
    whole = straight(sim)
    ids = whole["prompt_token_ids"] + whole["response_token_ids"][:k]
    cut = chat(sim.url, max_tokens=k, return_token_ids=True)
    rest = chat(sim.url, input_ids=ids, max_tokens=500 - k, return_token_ids=True)
    choice = rest["choices"][0]
    assert choice["response_token_ids"] == whole["response_token_ids"][k:]
    assert rest["usage"]["completion_tokens"] == 200 - k
    assert choice["finish_reason"] == "stop"
    # The raw texts join (separate_reasoning: false): the whole answer's, as /detokenize says.
    raw = chat(sim.url, input_ids=ids, max_tokens=500 - k, separate_reasoning=False)
    assert raw["choices"][0]["message"]["reasoning_content"] is None
    text = post(sim.url, "/detokenize", tokens=whole["response_token_ids"][:k])["text"]
    assert text + raw["choices"][0]["message"]["content"] == post(
        sim.url, "/detokenize", tokens=whole["response_token_ids"])["text"]
    first, then = cut["choices"][0]["message"], choice["message"]
    if k < 140:  # a cut before </think>: the split joins too
        for key in ("reasoning_content", "content"):
            assert (first[key] or "") + (then[key] or "") == whole["message"][key]
    else:  # after it the parser, starting afresh, reads the rest as thinking, as SGLang's does
        assert then["content"] == "" and then["reasoning_content"]


def test_generate_takes_input_ids_and_agrees_with_chat(sim):
    whole = straight(sim)
    answer = post(sim.url, "/generate", input_ids=whole["prompt_token_ids"],
                  sampling_params={"max_new_tokens": 500})
    assert answer["output_ids"] == whole["response_token_ids"]
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": 151645}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (
        len(whole["prompt_token_ids"]), 200)
    assert answer["text"] == ("<think>" + whole["message"]["reasoning_content"] + "</think>"
                              + whole["message"]["content"])  # the blank line is content
    cut = post(sim.url, "/generate", input_ids=whole["prompt_token_ids"] + answer["output_ids"][:9],
               sampling_params={"max_new_tokens": 5})
    assert cut["output_ids"] == whole["response_token_ids"][9:14]
    assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    text = post(sim.url, "/generate", text="a raw prompt", sampling_params={"max_new_tokens": 3})
    assert len(text["output_ids"]) == 3 and text["text"].startswith("<think>")


def test_tools_are_part_of_the_prompt_ids(sim):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    plain = straight(sim)["prompt_token_ids"]
    with_tools = chat(sim.url, max_tokens=5, tools=tools, return_token_ids=True)
    assert with_tools["choices"][0]["prompt_token_ids"] != plain
    assert with_tools["usage"]["prompt_tokens"] > len(plain)


def test_thinking_off_is_in_the_prompt_ids(sim):
    off = chat(sim.url, max_tokens=500, return_token_ids=True,
               chat_template_kwargs={"enable_thinking": False})["choices"][0]
    assert off["prompt_token_ids"][-4:] == [151667, 271, 151668, 271]
    assert 151667 not in off["response_token_ids"] and off["message"]["reasoning_content"] is None
    again = chat(sim.url, input_ids=off["prompt_token_ids"], max_tokens=500,
                 return_token_ids=True)["choices"][0]
    assert again["response_token_ids"] == off["response_token_ids"]


def test_streamed_chunks_carry_no_ids_as_in_0_5_23(sim):
    with httpx.stream("POST", sim.url + "/v1/chat/completions", timeout=30,
                      json={"messages": PROMPT, "max_tokens": 20, "stream": True,
                            "return_token_ids": True}) as r:
        body = r.read().decode()
    assert r.status_code == 200 and "token_ids" not in body


@pytest.mark.parametrize(("prefix", "held"), [
    ("<think>\nhmm hmm hmm", 5),  # inside the thinking
    # genq's prefix from the parsed split (the blank line after </think> is content): 143 held
    ("<think>\n" + " ".join(["hmm"] * 136) + "\n</think>\n\nok ok", 143),
])
def test_a_text_continuation_joins_to_the_straight_answer(sim, prefix, held):
    whole = straight(sim)["message"]
    rest = chat(sim.url, messages=[*PROMPT, {"role": "assistant", "content": prefix}],
                continue_final_message=True, max_tokens=500)
    message = rest["choices"][0]["message"]
    thought = prefix.removeprefix("<think>").partition("</think>")
    joined_reasoning = thought[0] + (message["reasoning_content"] or "")
    joined_content = thought[2] + message["content"]
    assert (joined_reasoning, joined_content) == (whole["reasoning_content"], whole["content"])
    assert rest["usage"]["completion_tokens"] == 200 - held


def test_completion_tokens_are_never_negative_past_the_answer(sim):
    """A text prefix longer than the prompt's whole answer: nothing left to decode."""
    prefix = "<think>" + " ".join(["hmm"] * 138) + "</think>" + " ".join(["ok"] * 300)
    rest = chat(sim.url, messages=[*PROMPT, {"role": "assistant", "content": prefix}],
                continue_final_message=True, max_tokens=50)
    assert rest["usage"]["completion_tokens"] == 0
    assert rest["choices"][0]["message"]["content"] == ""
    assert rest["choices"][0]["finish_reason"] == "stop"


def test_a_text_continuation_without_a_parser_adds_only_new_text():
    """Without --reasoning-parser the answer is raw text: a continuation after `</think>` adds
    its words and no second, empty `<think></think>` glued to the prefix's last word."""
    plain = SimProcess(*sim_flags(**{**FLAGS, "reasoning_parser": None})).start()
    try:
        whole = chat(plain.url, max_tokens=500)["choices"][0]["message"]["content"]
        cut = chat(plain.url, max_tokens=150)["choices"][0]["message"]["content"]
        rest = chat(plain.url, messages=[*PROMPT, {"role": "assistant", "content": cut}],
                    continue_final_message=True, max_tokens=350)
    finally:
        plain.cleanup()
    assert cut + rest["choices"][0]["message"]["content"] == whole
    assert rest["usage"]["completion_tokens"] == 50
