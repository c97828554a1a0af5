"""`stream: true` chat answers as SGLang 0.5 sends them: server-sent events, one
`chat.completion.chunk` per --stream-interval decode steps (default 1: a chunk per token), a
chunk with the finish reason, a usage chunk when `stream_options.include_usage` asks for it,
then `data: [DONE]`.

Like SGLang, the first chunk is awaited before the HTTP status is sent, so a request refused
or faulted before its first token still gets a plain HTTP error, and a hung one gets nothing."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from genq.simulator.engine import Engine
from genq.simulator.model import STOP_TOKEN_ID, Completion, texts, usage

_END = -1


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


class _Chunks:
    """Shapes the chunks of one answer."""

    def __init__(self, done: Completion, model: str, parser: bool) -> None:
        self.done, self.model, self.parser = done, model, parser
        self.id = uuid.uuid4().hex
        self.created = int(time.time())
        self.at = 0  # tokens shaped so far

    def chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
            "matched_stop": extra.pop("matched_stop", None),
        }
        return _event(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                **extra,
            }
        )

    def first(self) -> bytes:
        return self.chunk({"reasoning_content": None, "role": "assistant", "content": ""})

    def upto(self, tokens: int) -> list[bytes]:
        """The text decoded since the last chunk: none (a tag the parser keeps out of both
        fields), one chunk, or, where the thinking ends within these tokens, a reasoning chunk
        then a content chunk (SGLang never puts both in one delta). Built from the tokens added
        alone, so the deltas sum to exactly the non-streamed answer."""
        pieces = texts(self.done, self.parser, self.at, tokens, calls=False)
        self.at = tokens
        out = []
        for n, (key, text) in enumerate(zip(("reasoning_content", "content"), pieces,
                                            strict=True)):
            if text:  # SGLang writes reasoning_content, null, beside an answer's content
                out.append(self.chunk({key: text} if n == 0 else
                                      {"reasoning_content": None, key: text}))
        return out

    def finish(self) -> bytes:
        reason = self.done.finish_reason
        matched = STOP_TOKEN_ID if reason == "stop" else None
        return self.chunk({"reasoning_content": None}, reason, matched_stop=matched)

    def tool_call(self, call: dict[str, Any]) -> list[bytes]:
        """A parsed tool call as SGLang streams it: its id and name, then its arguments, then
        the finish chunk that says tool_calls."""
        head = {**call, "function": {"name": call["function"]["name"], "arguments": ""}}
        args = {"index": call["index"], "function": {"arguments": call["function"]["arguments"]}}
        return [self.chunk({"tool_calls": [head]}), self.chunk({"tool_calls": [args]}),
                self.chunk({"reasoning_content": None}, "tool_calls")]

    def usage(self, prompt_tokens: int) -> bytes:
        return _event(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage(self.done, prompt_tokens),
            }
        )


async def stream_chat(
    engine: Engine,
    done: Completion,
    prompt_tokens: int,
    model: str,
    parser: bool,
    include_usage: bool,
    call: dict[str, Any] | None = None,
) -> AsyncIterator[bytes]:
    """Start the request; return once its first token is out (or raise its error)."""
    progress: asyncio.Queue[int] = asyncio.Queue()

    async def drive() -> None:
        try:
            await engine.run(prompt_tokens, done, emit=progress.put_nowait)
        finally:
            progress.put_nowait(_END)

    runner = asyncio.create_task(drive())
    chunks = _Chunks(done, model, parser)
    try:
        first = await progress.get()
    except BaseException:
        runner.cancel()
        raise
    if first == _END:
        await runner  # raises the request's error (a fault status, say) as a plain answer
    return _events(runner, progress, chunks, first, prompt_tokens, include_usage, call)


async def _events(
    runner: asyncio.Task,
    progress: asyncio.Queue[int],
    chunks: _Chunks,
    first: int,
    prompt_tokens: int,
    include_usage: bool,
    call: dict[str, Any] | None,
) -> AsyncIterator[bytes]:
    try:
        yield chunks.first()
        tokens = first
        while tokens != _END:
            for piece in chunks.upto(tokens):
                yield piece
            tokens = await progress.get()
        await runner  # a reset fault ends the stream here, torn
        for end in chunks.tool_call(call) if call else [chunks.finish()]:
            yield end
        if include_usage:
            yield chunks.usage(prompt_tokens)
        yield b"data: [DONE]\n\n"
    finally:
        if not runner.done():
            runner.cancel()  # the client went away: abort the request, freeing its slot
            await asyncio.gather(runner, return_exceptions=True)
