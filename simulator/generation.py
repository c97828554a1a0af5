"""The two generation endpoints: validate a request like SGLang, run it, shape the answer."""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from simulator.engine import ApiError, Engine
from simulator.model import STOP_TOKEN_ID, Completion, complete, count_words, natural_length

# SGLang's default when a request gives no limit (`max_new_tokens` 128); the chat endpoint
# falls back to the same here, so a client that forgets the limit sees short, cut answers.
DEFAULT_MAX_TOKENS = 128


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ApiError(400, f"{name} must be a positive integer, got {value!r}")
    return value


def _check_sampling(params: dict[str, Any]) -> None:
    temperature = params.get("temperature")
    if temperature is None:
        return
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise ApiError(400, f"temperature must be a number, got {temperature!r}")
    if temperature < 0:
        raise ApiError(400, f"temperature must be >= 0, got {temperature}")


def _message_text(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    texts = []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ApiError(400, "each message must be an object with a role")
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


def _no_stream(data: dict[str, Any]) -> None:
    if data.get("stream"):
        raise ApiError(400, "the simulator does not stream; send stream: false")


async def chat(engine: Engine, body: bytes) -> dict[str, Any]:
    """`POST /v1/chat/completions`, answered in the OpenAI shape SGLang uses."""
    data = _json_object(body)
    _no_stream(data)
    text = _message_text(data.get("messages"))
    limit = data.get("max_completion_tokens", data.get("max_tokens"))
    max_tokens = DEFAULT_MAX_TOKENS if limit is None else _positive_int(limit, "max_tokens")
    _check_sampling(data)
    _check_marker(engine, text)
    kwargs = data.get("chat_template_kwargs") or {}
    thinking = bool(kwargs.get("enable_thinking", True)) if isinstance(kwargs, dict) else True
    prompt_tokens = max(1, count_words(text))
    done = complete(
        natural_length(text, engine.settings.seed, engine.settings.length_dist),
        max_tokens,
        thinking,
    )
    await engine.run(prompt_tokens, done)
    model = data.get("model")
    return _chat_body(
        done, prompt_tokens, model if isinstance(model, str) and model else engine.settings.model
    )


def _chat_body(done: Completion, prompt_tokens: int, model: str) -> dict[str, Any]:
    finish = done.finish_reason
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
                    "content": done.content_text(),
                    "reasoning_content": done.reasoning_text(),
                    "tool_calls": None,
                },
                "logprobs": None,
                "finish_reason": finish,
                "matched_stop": STOP_TOKEN_ID if finish == "stop" else None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": done.tokens,
            "total_tokens": prompt_tokens + done.tokens,
            "reasoning_tokens": done.reasoning_tokens,
            "prompt_tokens_details": None,
        },
    }


def _generate_prompt(data: dict[str, Any]) -> tuple[str, int]:
    text, ids = data.get("text"), data.get("input_ids")
    if isinstance(text, str) and text:
        return text, max(1, count_words(text))
    if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
        return ",".join(map(str, ids)), len(ids)
    raise ApiError(400, "give a non-empty `text` or a list of integer `input_ids`")


async def generate(engine: Engine, body: bytes) -> dict[str, Any]:
    """SGLang's native `POST /generate`; the raw text carries the thinking in <think> tags."""
    data = _json_object(body)
    _no_stream(data)
    text, prompt_tokens = _generate_prompt(data)
    params = data.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise ApiError(400, "sampling_params must be an object")
    limit = params.get("max_new_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if limit is None else _positive_int(limit, "max_new_tokens")
    _check_sampling(params)
    _check_marker(engine, text)
    done = complete(
        natural_length(text, engine.settings.seed, engine.settings.length_dist), max_tokens, True
    )
    started = time.monotonic()
    await engine.run(prompt_tokens, done)
    finish: dict[str, Any] = (
        {"type": "stop", "matched": STOP_TOKEN_ID}
        if done.finish_reason == "stop"
        else {"type": "length", "length": done.tokens}
    )
    return {
        "text": done.raw_text(),
        "meta_info": {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": done.tokens,
            "cached_tokens": 0,
            "e2e_latency": time.monotonic() - started,
        },
    }
