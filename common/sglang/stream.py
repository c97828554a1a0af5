"""The SGLang wire format: chat answers, the load and HTTP error verdicts, as pure functions
tests feed real answers."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import orjson

from genq.common.errors import BadTask, ServerAborted, ServerUnavailable, TryAgain

# Statuses that say "try again later", not "this request is wrong".
RETRYABLE_STATUS = {408, 425, 429}
# The only finish reasons that make a result; anything else (abort, missing) is run again.
# SGLang with --tool-call-parser says "tool_calls" where an answer that stopped called a tool.
FINISHED = ("stop", "length", "tool_calls")
# SGLang's two context-length refusals (tokenizer_manager), answered as HTTP 400.
TOTAL_TOO_LONG = re.compile(r"maximum context length of (\d+) tokens.*?(\d+) tokens from the input")
INPUT_TOO_LONG = re.compile(r"The input \((\d+) tokens\) is longer than the model's context")
# No context holds this many tokens; a count past it (or negative, or not a whole number) is a
# broken server, and written as sent it would wrap the u32 fields the run's figures sum.
MAX_TOKEN_COUNT = 2**31 - 1


@dataclass(frozen=True, kw_only=True)
class Completion:
    finish_reason: str
    content: str
    reasoning_content: str | None
    prompt_tokens: int
    completion_tokens: int
    # Set only when genq had to lower max_tokens so prompt + completion fit the context.
    max_tokens: int | None = None
    # Set on an answer continued from a partial one: {version, attempt, tokens} of the partial.
    continued_from: dict[str, int] | None = None
    # The calls the server's tool-call parser took out of the answer's text (OpenAI's shape).
    tool_calls: list[dict[str, Any]] | None = None
    # The server's own token ids (asked with return_token_ids): what the model read and wrote.
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    # The stop token id or string the answer ended on (SGLang's `matched_stop`): the server
    # leaves it out of the text, and a text made again from the ids must too.
    matched_stop: int | str | None = None
    # Prompt tokens the server found in its prefix cache; None where it does not say.
    cached_tokens: int | None = None


class ContextExceeded(TryAgain):
    """Prompt + max_tokens do not fit the context; SGLang.chat() retries once with what fits."""

    def __init__(self, message: str, context: int, input_tokens: int) -> None:
        super().__init__(message)
        self.context, self.input_tokens = context, input_tokens


class InputTooLong(TryAgain):
    """The input alone fills this server's context: not a bad prompt (another server may take
    it), and a continuation's partial that no longer fits is generated anew."""


class Answer:
    """The pieces of a streamed answer (server-sent events, one JSON chunk per `data:` line)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] | None = None
        self.finish: str | None = None
        self.usage: dict[str, Any] = {}
        self.calls: dict[int, dict[str, Any]] = {}  # tool calls by their index, as they grow
        self.done = False

    def feed(self, line: bytes, index: int, url: str) -> bool:
        """Take one line; True at the end of the stream. Constant work per chunk: an answer is
        thousands of chunks."""
        if not line.startswith(b"data:"):
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return True
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise ServerUnavailable(f"{url}: malformed stream chunk {data[:200]!r}") from None
        if isinstance(chunk.get("error"), dict):  # an error after the answer had started
            error = chunk["error"]
            code = error.get("code") if isinstance(error.get("code"), int) else 500
            raise status_error(code, str(error.get("message")), index, url)
        if usage := chunk.get("usage"):
            self.usage = usage
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if text := delta.get("content"):
                self.content.append(text)
            if (thought := delta.get("reasoning_content")) is not None:
                self.reasoning = self.reasoning or []
                self.reasoning.append(thought)
            for part in delta.get("tool_calls") or ():
                self.add_call(part)
            if finish := choice.get("finish_reason"):
                self.finish = finish
        return False

    def add_call(self, part: dict[str, Any]) -> None:
        """A streamed tool call comes in pieces keyed by its index: the id and name once, the
        arguments as text to append."""
        call = self.calls.setdefault(int(part.get("index") or 0),
                                     {"id": None, "type": "function",
                                      "function": {"name": None, "arguments": ""}})
        call["id"] = part.get("id") or call["id"]
        function = part.get("function") or {}
        call["function"]["name"] = function.get("name") or call["function"]["name"]
        call["function"]["arguments"] += function.get("arguments") or ""

    def completion(self, url: str, *, thinking: bool) -> Completion:
        if not self.done:
            raise ServerUnavailable(f"{url}: the answer stream ended before [DONE]")
        reasoning = "".join(self.reasoning) if self.reasoning is not None else None
        calls = [self.calls[i] for i in sorted(self.calls)] or None
        return finished(url, self.finish, "".join(self.content), reasoning, self.usage,
                        thinking=thinking, tool_calls=calls)


def whole_answer(body: bytes, url: str, *, thinking: bool) -> Completion:
    """A chat answer sent whole (`stream: false`)."""
    try:
        data = orjson.loads(body)
        choice, usage = data["choices"][0], data.get("usage") or {}
        message = choice.get("message") or {}
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
        raise ServerUnavailable(f"{url}: malformed answer {body[:200]!r}") from None
    matched = choice.get("matched_stop")
    done = finished(url, choice.get("finish_reason"), message.get("content") or "",
                    message.get("reasoning_content"), usage, thinking=thinking,
                    tool_calls=message.get("tool_calls") or None,
                    matched_stop=matched if type(matched) in (int, str) else None)
    if "response_token_ids" not in choice:
        return done
    prompt_ids, ids = choice.get("prompt_token_ids"), choice.get("response_token_ids")
    if not (token_ids(prompt_ids) and token_ids(ids)):
        raise ServerUnavailable(f"{url}: malformed token ids in answer {body[:200]!r}")
    # Records and exports keep ids as int32 (a vocabulary fits): one past it is a broken answer.
    if (bad := next((i for i in (*prompt_ids, *ids) if not 0 <= i <= MAX_TOKEN_COUNT),
                    None)) is not None:
        raise ServerUnavailable(f"{url}: token id {bad} outside 0..{MAX_TOKEN_COUNT} in answer")
    return replace(done, prompt_token_ids=prompt_ids, completion_token_ids=ids)


def token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(i) is int for i in value)


def finished(url: str, finish: str | None, content: str, reasoning: str | None,
             usage: dict[str, Any], *, thinking: bool,
             tool_calls: list[dict[str, Any]] | None = None,
             matched_stop: int | str | None = None) -> Completion:
    """The result of an answer, or the error that says why there is none."""
    if finish == "abort":
        raise ServerAborted(f"{url}: the server aborted the generation (finish_reason abort)")
    if finish not in FINISHED:
        raise TryAgain(f"{url}: no finished result (finish_reason {finish!r})")
    if reasoning is None and thinking:
        reasoning, content = split_thinking(content)
    return Completion(
        finish_reason=finish, content=content, reasoning_content=reasoning,
        prompt_tokens=token_count(usage, "prompt_tokens", url),
        completion_tokens=token_count(usage, "completion_tokens", url), tool_calls=tool_calls,
        cached_tokens=cached_count(usage, url), matched_stop=matched_stop)


def token_count(usage: Any, key: str, url: str) -> int:
    """A usage count as sent (0 when absent), or ServerUnavailable for one no server could mean."""
    count = (usage.get(key) or 0) if isinstance(usage, dict) else None  # None: not an object
    if type(count) is not int or not 0 <= count <= MAX_TOKEN_COUNT:
        raise ServerUnavailable(f"{url}: implausible usage {key}={count!r}")
    return count


def cached_count(usage: Any, url: str) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens`, or None where the answer has none: SGLang
    sends it only with --enable-cache-report (0 on a miss); without, the details are null."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if not isinstance(details, dict) or details.get("cached_tokens") is None:
        return None
    return token_count(details, "cached_tokens", url)


def split_thinking(text: str) -> tuple[str | None, str]:
    """Split thinking a server without --reasoning-parser left in content as SGLang's qwen3
    parser does; without `</think>` only a leading `<think>` marks (unfinished) thinking."""
    body = text.lstrip()
    if "</think>" in text:
        thought, _, answer = text.partition("</think>")
        return thought.strip().removeprefix("<think>").strip(), answer.lstrip()
    if body.startswith("<think>"):
        return body.removeprefix("<think>").strip(), ""
    return None, text


def parse_reasoning(text: str, forced: bool) -> tuple[str | None, str]:
    """(reasoning_content, content) of a whole answer's raw text as SGLang 0.5.23's qwen3
    parser gives them (Qwen3Detector.detect_and_parse, then the chat answer: empty thinking is
    null). It strips nothing; `forced` (thinking on) reads tagless text as thinking, and a
    `<tool_call>` before any `</think>` ends the thinking."""
    if not forced and "<think>" not in text:
        return None, text
    while text.startswith("<think>"):
        text = text[len("<think>"):]
    if "</think>" in text:
        thought, _, answer = text.partition("</think>")
    elif (at := text.find("<tool_call>")) != -1:
        thought, answer = text[:at], text[at:]
    else:
        thought, answer = text, ""
    return thought or None, answer


def parse_load(data: Any) -> dict[str, Any]:
    """/v1/loads is {"loads": [per rank]}; requests, KV-cache use and decode speed are summed
    over the ranks (None where absent): what the capacity advice weighs."""
    ranks = data["loads"] or []

    def total(key: str, cast: type = int) -> Any:
        values = [rank.get(key) for rank in ranks if rank.get(key) is not None]
        return sum(cast(v) for v in values) if values else None

    used, pool = total("num_used_tokens"), total("max_total_num_tokens")
    usage = used / pool if used is not None and pool else None
    return {"num_reqs": total("num_running_reqs") or 0,
            "num_waiting_reqs": total("num_waiting_reqs") or 0,
            "max_running_requests": total("max_running_requests") or None,
            "num_used_tokens": used, "max_total_num_tokens": pool,
            "token_usage": round(usage, 4) if usage is not None else None,
            "gen_throughput": total("gen_throughput", float)}


def load_moved(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Two load reads show the server working: running requests whose number, KV use or decode
    speed changed. A queue is no sign: a server that stopped decoding keeps its queue."""
    keys = ("num_reqs", "num_used_tokens", "gen_throughput")
    return after["num_reqs"] > 0 and any(before[key] != after[key] for key in keys)


def status_error(status: int, message: str, index: int, url: str,
                 retry_after: str | None = None) -> Exception:
    """The verdict on an HTTP error answer to a generation request (with its Retry-After)."""
    if status >= 500 or status in RETRYABLE_STATUS:
        wait = float(retry_after) if retry_after and retry_after.isdigit() else None
        return ServerUnavailable(f"{url}: HTTP {status}: {message}", retry_after=wait)
    if status == 400 and (m := TOTAL_TOO_LONG.search(message)):
        context, input_tokens = int(m.group(1)), int(m.group(2))
        if input_tokens < context:
            return ContextExceeded(message, context, input_tokens)
    if status == 400 and INPUT_TOO_LONG.search(message):
        # Too long for this server's context, not a bad prompt: another server may take it.
        return InputTooLong(f"{url}: {message}")
    return BadTask(index, f"server refused the request (HTTP {status}): {message}")


def thinking_on(body: dict[str, Any]) -> bool:
    kwargs = body.get("chat_template_kwargs") or {}
    return bool(kwargs.get("enable_thinking", True)) if isinstance(kwargs, dict) else True


def error_message(content: bytes) -> str:
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode(errors="replace")[:500]
    if isinstance(data, dict):
        # SGLang's error object {"message"}, FastAPI's {"detail"}, or {"error": {...}}
        error = data.get("error")
        text = data.get("message") or data.get("detail") or (
            error.get("message") if isinstance(error, dict) else error)
        return str(text or data)[:500]
    return str(data)[:500]
