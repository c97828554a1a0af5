"""The two generation endpoints: validate a request like SGLang, run it, shape the answer."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import orjson

from genq.simulator import schema, tokens, toolcalls
from genq.simulator.engine import ApiError, Engine
from genq.simulator.model import (
    STOP_TOKEN_ID,
    Completion,
    complete,
    natural_length,
    parsed,
    prompt_key,
    resume_at,
    texts,
    unit_draw,
    usage,
)
from genq.simulator.streaming import stream_chat

# The error type SGLang gives when its request model (pydantic) rejects the body.
PYDANTIC = "Bad Request"
# SGLang's default when a request gives no limit (`max_new_tokens` 128); the chat endpoint
# falls back to the same here, so a client that forgets the limit sees short, cut answers.
DEFAULT_MAX_TOKENS = 128


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"invalid JSON body: {exc}", PYDANTIC) from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", PYDANTIC)
    return data


def _token_limit(value: Any, name: str) -> int:
    # SGLang takes 0 (an empty answer, finish "length") and refuses negatives.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {value!r}")
    if value < 0:
        raise ApiError(400, f"max_new_tokens must be at least 0, got {value}.")
    return value


def _check_context(engine: Engine, prompt_tokens: int, max_tokens: int) -> None:
    """SGLang's two context-length refusals, word for word (its tokenizer manager)."""
    context = engine.settings.context_length
    if prompt_tokens >= context:
        raise ApiError(
            400,
            f"The input ({prompt_tokens} tokens) is longer than the model's context length "
            f"({context} tokens).",
        )
    if prompt_tokens + max_tokens > context:
        raise ApiError(
            400,
            "Requested token count exceeds the model's maximum context length of "
            f"{context} tokens. You requested a total of {prompt_tokens + max_tokens} tokens: "
            f"{prompt_tokens} tokens from the input messages and {max_tokens} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit.",
        )


def _check_sampling(params: dict[str, Any]) -> None:
    temperature = params.get("temperature")
    if temperature is None:
        return
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise ApiError(400, f"temperature must be a number, got {temperature!r}")
    if temperature < 0:
        raise ApiError(400, f"temperature must be >= 0, got {temperature}")


def _final_assistant(data: dict[str, Any]) -> tuple[Any, str]:
    """SGLang's continue_final_message: the final assistant message is the answer's start."""
    messages = data.get("messages")
    if (data.get("continue_final_message") and isinstance(messages, list) and len(messages) > 1
            and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"
            and isinstance(messages[-1].get("content"), str)):
        return messages[:-1], messages[-1]["content"]
    return messages, ""


def _message_text(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", PYDANTIC)
    texts = []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ApiError(400, "each message must be an object with a role", PYDANTIC)
        content = message.get("content")
        if isinstance(content, list):
            # OpenAI content parts: only the text parts count toward the prompt.
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        texts.append(content if isinstance(content, str) else "")
    return "\n".join(texts)


def _check_marker(engine: Engine, text: str) -> None:
    marker = engine.settings.bad_marker
    if marker and marker in text:
        raise ApiError(400, f"The input contains the rejected marker {marker!r} (simulated).")
    failing = engine.faults.error_marker
    if failing and failing in text:
        engine.stats.fault_errors += 1
        raise ApiError(503, "simulated fault: HTTP 503 for this prompt", "ServiceUnavailableError",
                       engine.faults.retry_after)


def _check_tool_choice(data: dict[str, Any]) -> None:
    """SGLang 0.5.x refuses a tool_choice that must call a tool ("required", or one named)
    beside no tools, with these words."""
    choice, tools = data.get("tool_choice"), data.get("tools")
    if tools or choice is None or choice in ("auto", "none"):
        return
    which = "required" if choice == "required" else "a specific tool"
    raise ApiError(400, f"Tools cannot be empty if tool choice is set to {which}.")


def _tools_parsed(engine: Engine, data: dict[str, Any]) -> bool:
    """Whether the answer's text goes through the tool-call parser (SGLang: a parser at
    launch, tools in the request, tool_choice not "none")."""
    tools = data.get("tools")
    return (engine.settings.tool_call_parser is not None and isinstance(tools, list)
            and bool(tools) and data.get("tool_choice") != "none")


def _chain_goes_on(messages: Any, seed: int) -> bool:
    """--tool-chains: whether the tool results after the last user message are fewer than
    that message's toolcalls.chain_length (then the answer calls; else it closes in text)."""
    if not isinstance(messages, list):
        return False
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    last = max((at for at, role in enumerate(roles) if role == "user"), default=-1)
    text = _message_text(messages[last:last + 1]) if last >= 0 else ""
    return roles[last + 1:].count("tool") < toolcalls.chain_length(text, seed)


def _call_ids(engine: Engine, data: dict[str, Any], text: str, context: list[int]
              ) -> tuple[int, ...]:
    """The ids of the tool call the answer ends with, none when it calls nothing: an answer
    to a request with tools calls the first one with probability --tool-call-rate (unless
    tool_choice is "none"), drawn from the prompt's ids and the request's seed apart from the
    length's draw, so the same request decides the same way every time (under --tool-chains,
    while the request's chain goes on instead; every tool, the last first, under
    --parallel-calls); its arguments count the prompt's words."""
    if not _tools_parsed(engine, data):
        return ()
    tools = data["tools"]
    function = tools[0].get("function") if isinstance(tools[0], dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, "each tool must be {type: function, function: {name, ...}}", PYDANTIC)
    settings = engine.settings
    if settings.tool_chains:
        if not _chain_goes_on(data.get("messages"), settings.seed):
            return ()
    elif unit_draw(prompt_key(tokens.split_prompt(context)[0], data.get("seed")) + "|tool",
                   settings.seed) >= settings.tool_call_rate:
        return ()
    names = [function["name"]]
    if settings.parallel_calls:
        names = [t["function"]["name"] for t in reversed(tools)
                 if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    calls = "\n".join(toolcalls.call_text(name, {"words": len(text.split())}) for name in names)
    return tuple(tokens.encode(calls, answer=True))


def _called(engine: Engine, data: dict[str, Any], content: str, finish: str | None
            ) -> tuple[str, list[dict[str, Any]] | None, str | None]:
    """The content, calls and finish SGLang's chat gives after its tool-call parser: an answer
    that stopped and called says `tool_calls`."""
    if not _tools_parsed(engine, data) or toolcalls.BOT not in content:
        return content, None, finish
    normal, calls = toolcalls.parse(content, data.get("tools"))
    if not calls:
        return normal, None, finish
    return normal, toolcalls.openai(calls), "tool_calls" if finish == "stop" else finish



def _no_stream(data: dict[str, Any]) -> None:
    if data.get("stream"):
        raise ApiError(400, "the simulator streams chat completions only; send stream: false")


def _input_ids(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, list) and value and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        return value
    raise ApiError(400, "input_ids must be a non-empty list of token ids", PYDANTIC)


def _answer(engine: Engine, context: list[int], max_tokens: int, seed: Any,
            call: tuple[int, ...] = ()) -> Completion:
    """The model's answer to a context of ids: the straight answer to its prompt (ending with
    `call`'s text), from where the answer it already holds (after the generation prompt)
    leaves off."""
    _check_context(engine, len(context), max_tokens)
    prompt, generated, thinking = tokens.split_prompt(context)
    settings = engine.settings
    natural = natural_length(prompt_key(prompt, seed), settings.seed, settings.length_dist)
    done = complete(natural, max_tokens, thinking,
                    resume_at(generated, natural, thinking, call), call)
    return dataclasses.replace(done, cached_tokens=engine.prefix.take(context, done.ids()))


async def chat(engine: Engine, body: bytes) -> Any:
    """`POST /v1/chat/completions`, answered in the OpenAI shape SGLang uses: one JSON body,
    or with `stream: true` an async iterator of server-sent events. The prompt is the messages
    through the chat template, or the request's `input_ids` (template skipped); a final
    assistant message sent with `continue_final_message` is the answer's start."""
    data = _json_object(body)
    messages, prefix = _final_assistant(data)
    text = _message_text(messages)
    limit = data.get("max_completion_tokens", data.get("max_tokens"))
    max_tokens = DEFAULT_MAX_TOKENS if limit is None else _token_limit(limit, "max_tokens")
    _check_sampling(data)
    _check_tool_choice(data)
    _check_marker(engine, text)
    kwargs = data.get("chat_template_kwargs") or {}
    thinking = bool(kwargs.get("enable_thinking", True)) if isinstance(kwargs, dict) else True
    context = _input_ids(data.get("input_ids")) or tokens.render(
        messages, data.get("tools"), thinking, prefix)
    done = _answer(engine, context, max_tokens, data.get("seed"),
                   _call_ids(engine, data, text, context))
    # The cache is there either way; the flag only says whether the answer reports its hits.
    done = dataclasses.replace(done, forced_finish=engine.faults.forced_finish(),
                               cache_report=engine.settings.enable_cache_report)
    # SGLang echoes the request's model, or says "default" when there is none.
    model = data.get("model") if isinstance(data.get("model"), str) else "default"
    parser = engine.settings.reasoning_parser is not None and data.get("separate_reasoning",
                                                                           True) is not False
    if data.get("stream"):  # 0.5.23 streams no ids, return_token_ids or not
        options = data.get("stream_options") or {}
        usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
        raw = texts(done, parser=False)[1]
        calls = _called(engine, data, raw, done.finish_reason)[1]
        call = calls[0] if calls and done.finish_reason == "stop" else None
        return await stream_chat(engine, done, len(context), model, parser, usage, call)
    await engine.run(len(context), done)
    raw = texts(done, parser=False)[1]
    reasoning, content = parsed(raw, thinking, prefix) if parser else (None, raw)
    content, calls, finish = _called(engine, data, content, done.finish_reason)
    answer = _chat_body(done, len(context), model, (reasoning, content), calls, finish)
    if data.get("return_token_ids") and not engine.settings.no_token_ids:
        answer["choices"][0].update(prompt_token_ids=context, response_token_ids=done.ids())
    return schema.shaped(engine, data, text, answer)


def _chat_body(done: Completion, prompt_tokens: int, model: str,
               split: tuple[str | None, str], calls: list[dict[str, Any]] | None,
               finish: str | None) -> dict[str, Any]:
    reasoning, content = split
    return {
        "id": uuid.uuid4().hex,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "reasoning_content": reasoning,
                    "tool_calls": calls,
                },
                "logprobs": None,
                "finish_reason": finish,
                "matched_stop": STOP_TOKEN_ID if finish == "stop" else None,
            }
        ],
        "usage": usage(done, prompt_tokens),
    }


def _generate_prompt(data: dict[str, Any]) -> tuple[str, list[int]]:
    text, ids = data.get("text"), data.get("input_ids")
    if isinstance(text, str) and text:
        return text, tokens.encode(text)
    if ids is not None:
        return "", _input_ids(ids) or []
    raise ApiError(400, "give a non-empty `text` or a list of integer `input_ids`")


async def generate(engine: Engine, body: bytes) -> dict[str, Any]:
    """SGLang's native `POST /generate`: `text` or `input_ids` is the whole context (no
    template); the answer's raw text carries the thinking in <think> tags, `output_ids` its
    ids."""
    data = _json_object(body)
    _no_stream(data)
    text, context = _generate_prompt(data)
    params = data.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise ApiError(400, "sampling_params must be an object")
    limit = params.get("max_new_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if limit is None else _token_limit(limit, "max_new_tokens")
    _check_sampling(params)
    _check_marker(engine, text)
    done = _answer(engine, context, max_tokens, params.get("sampling_seed"))
    started = time.monotonic()
    await engine.run(len(context), done)
    finish: dict[str, Any] = (
        {"type": "stop", "matched": STOP_TOKEN_ID}
        if done.finish_reason == "stop"
        else {"type": "length", "length": done.tokens}
    )
    return {
        "text": texts(done, parser=False)[1],
        "output_ids": done.ids(),
        "meta_info": {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(context),
            "completion_tokens": done.tokens,
            "cached_tokens": done.cached_tokens,
            # 0.5.23 says where the hit was kept (all on the GPU here), null on a miss.
            "cached_tokens_details": ({"device": done.cached_tokens, "host": 0}
                                      if done.cached_tokens else None),
            "e2e_latency": time.monotonic() - started,
        },
    }


def detokenize(engine: Engine, body: bytes) -> dict[str, Any]:
    """SGLang's `POST /detokenize` (and `/v1/detokenize`): ids, or lists of them, to the text
    its tokenizer decodes, special tokens skipped unless told otherwise."""
    data = _json_object(body)
    ids, skip = data.get("tokens"), bool(data.get("skip_special_tokens", True))
    if not isinstance(ids, list):
        raise ApiError(400, "tokens must be a list of token ids or of lists of them", PYDANTIC)
    batch = bool(ids) and all(isinstance(each, list) for each in ids)
    decoded = [tokens.decode(_input_ids(each) if each else [], skip_special=skip)
               for each in (ids if batch else [ids])]
    return {"text": decoded if batch else decoded[0]}


def parse_function_call(body: bytes) -> dict[str, Any]:
    """SGLang's `POST /parse_function_call`: {text, tool_call_parser, tools} to the text
    before the calls and the calls the parser finds ({tool_index, name, parameters})."""
    data = _json_object(body)
    text, parser = data.get("text"), data.get("tool_call_parser")
    if not isinstance(text, str):
        raise ApiError(400, "text must be a string", PYDANTIC)
    if parser not in toolcalls.PARSERS:
        raise ApiError(400, f"Unsupported tool_call_parser: {parser}")
    normal, calls = toolcalls.parse(text, data.get("tools"))
    return {"normal_text": normal, "calls": calls}
