"""`genq requeue --continue` end to end: the partial answers it keeps in Redis (zstd JSON per
truncated index, each stamped with the one parameter version it was made for), looked up and
dropped, whether and how one is continued (its request built by common/task.py's Request), and
joined to it. The requeue, the consumer, the probe and `genq recover` call this module."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis
import structlog
import zstandard

from genq.common.queue.keys import RunKeys
from genq.common.queue.replies import blob
from genq.common.sglang.client import SGLang
from genq.common.sglang.stream import (
    Completion,
    InputTooLong,
    parse_reasoning,
    split_thinking,
    thinking_on,
)
from genq.common.task import Request, task_of

logger = structlog.get_logger()

# What a partial carries: the answer so far (its ids in a --token-ids run), which result it
# was, the conversation turn it is (a --turns all run continues that turn only), and
# `for_version`.
FIELDS = ("reasoning_content", "content", "completion_tokens", "prompt_tokens", "params_version",
          "attempt", "prompt_token_ids", "completion_token_ids", "turn")


def tagged(record: dict[str, Any]) -> bool:
    """A think tag in the text: sent back as text, the server would split the prefix anew."""
    texts = (record.get("reasoning_content") or "") + (record.get("content") or "")
    return "<think>" in texts or "</think>" in texts


def continuable(record: dict[str, Any]) -> bool:
    """Whether a truncated record can be continued: it holds tokens, and its ids (continued by
    them, cut wherever) or text without a think tag."""
    return (record.get("finish_reason") == "length"
            and int(record.get("completion_tokens") or 0) > 0
            and (record.get("completion_token_ids") is not None or not tagged(record)))


# Partials one HSET carries: memory and each command stay bounded however many there are.
BATCH = 500


def put(r: redis.Redis, k: RunKeys, records: Iterable[dict[str, Any]],
        version: int, samples: int = 1) -> tuple[int, int, int]:
    """Store the partials of these records for parameter version `version` only, in place of
    any kept before, a batch at a time as they are read, each under its task (task.task_of
    with the run's `samples`); (how many, their tokens, bytes)."""
    packer = zstandard.ZstdCompressor(level=3)
    drop_all(r, k)
    count = tokens = size = 0
    rows = iter(records)
    while batch := list(itertools.islice(rows, BATCH)):
        packed = {str(task): packer.compress(orjson.dumps(
            {**{f: rec.get(f) for f in FIELDS}, "for_version": version}))
            for rec in batch if (task := task_of(rec, samples)) is not None}
        r.hset(k.partials, mapping=packed)  # type: ignore[arg-type]  # redis-py: invariant key
        count += len(batch)
        tokens += sum(int(rec["completion_tokens"]) for rec in batch)
        size += sum(len(v) for v in packed.values())
    return count, tokens, size


def keep(r: redis.Redis, k: RunKeys, records: Iterable[dict[str, Any]],
         version: int, samples: int = 1) -> tuple[int, int, int]:
    """`put`, and the run's manifest learns that `version` continues: `genq recover` keeps
    the partials it still needs."""
    r.hset(k.meta, "continues", version)
    return put(r, k, records, version, samples)


def drop_all(r: redis.Redis, k: RunKeys) -> None:
    """Forget every partial: the parameters they were made for are no longer the newest."""
    r.unlink(k.partials)


class Partials:
    """A consumer's side: the partial its task continues. Partials are kept before the version
    they are for exists, so the first task of each newer version asks whether any are kept (one
    round trip, shared by the tasks that start with it); once the hash is seen empty, the
    version's other tasks ask nothing."""

    def __init__(self, r: aioredis.Redis, k: RunKeys) -> None:
        self.redis, self.keys = r, k
        self.checked = 0  # the newest version whose partials were looked for
        self.kept: asyncio.Future[int] | None = None  # whether any were kept for it
        self.empty = False  # seen empty since

    def reset(self) -> None:
        """Look again from the first task on: a recover may number versions anew."""
        self.checked, self.kept, self.empty = 0, None, False

    async def may_hold(self, version: int) -> bool:
        if version > self.checked:
            self.checked, self.empty = version, False
            self.kept = asyncio.ensure_future(self.redis.exists(self.keys.partials))
        if version != self.checked or self.empty or self.kept is None:
            return False
        try:
            return bool(await self.kept)
        except BaseException:
            self.reset()  # Redis trouble: the next task asks again
            raise

    async def get(self, index: int, version: int) -> dict[str, Any] | None:
        """The partial kept for this index and a task of `version`; one made for another
        version is never used."""
        if not await self.may_hold(version):
            return None
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(self.keys.partials, str(index))
        pipe.exists(self.keys.partials)
        got, left = await pipe.execute()
        self.empty = not left
        raw = blob(got)
        partial = orjson.loads(zstandard.ZstdDecompressor().decompress(raw)) if raw else None
        return partial if partial and partial.get("for_version") == version else None

    async def drop(self, index: int, version: int) -> None:
        """Forget this index's partial (it failed for good, or its continuation was refused)."""
        if await self.may_hold(version):
            await self.redis.hdel(self.keys.partials, str(index))

    async def answer(self, index: int, version: int, request: Request,
                     ask: Callable[[dict[str, Any]], Awaitable[Completion]],
                     server: SGLang | None = None, turn: int | None = None
                     ) -> Completion | None:
        """The whole answer continued from this task's partial, or None (none, or refused:
        generate it from the start). Given the conversation `turn` being made, a partial of
        another turn is refused."""
        partial = await self.get(index, version)
        if partial is None:
            return None
        whole = None if turn is not None and partial.get("turn") != turn \
            else await continue_answer(ask, request, partial, server)
        if whole is None:
            await self.drop(index, version)
        return whole


def joined(partial: dict[str, Any], new: Completion) -> Completion:
    """The whole answer: the partial's texts (and ids) then the continuation's, tokens summed,
    the continuation's finish_reason."""
    reasoning, more = partial.get("reasoning_content"), new.reasoning_content
    ids, more_ids = partial.get("completion_token_ids"), new.completion_token_ids
    return replace(new, reasoning_content=None if reasoning is None and more is None
                   else (reasoning or "") + (more or ""),
                   content=(partial.get("content") or "") + new.content,
                   completion_tokens=int(partial["completion_tokens"]) + new.completion_tokens,
                   # Lowered to fit the context: the whole answer had the partial's tokens too.
                   max_tokens=None if new.max_tokens is None
                   else new.max_tokens + int(partial["completion_tokens"]),
                   prompt_token_ids=partial.get("prompt_token_ids") if ids else None,
                   completion_token_ids=[*ids, *more_ids] if ids and more_ids is not None
                   else None,
                   continued_from={"version": partial["params_version"],
                                   "attempt": partial["attempt"],
                                   "tokens": int(partial["completion_tokens"])})


# Request fields by which SGLang holds an answer to a grammar of its own.
GRAMMARS = ("regex", "ebnf", "json_schema", "structural_tag")


def grammar_from_start(body: dict[str, Any]) -> bool:
    """Whether the server holds the answer to a grammar from its first token: a forced call
    (tool_choice required or named, beside tools), a response_format, or a raw grammar field.
    Sent `input_ids`, SGLang 0.5.23 starts that grammar again after the partial (a cut forced
    call came back with a second `<tool_call>` opened inside the first), so such an answer
    cannot be continued by ids."""
    forced = bool(body.get("tools")) and body.get("tool_choice") not in (None, "auto", "none")
    answer_format = (body.get("response_format") or {}).get("type", "text") != "text"
    return forced or answer_format or any(body.get(key) for key in GRAMMARS)


async def continue_answer(ask: Callable[[dict[str, Any]], Awaitable[Completion]],
                          request: Request, partial: dict[str, Any],
                          server: SGLang | None = None) -> Completion | None:
    """The whole answer to `request` continued from `partial` (a record's fields) with `ask`,
    by its ids in a run that keeps them (its texts from `server`), else by its text (the
    request the partial goes on from is Request.body's); or None if it cannot be or the server
    did not take the partial as its start (generate it again)."""
    body = request.body()
    prompt_tokens, by_ids = int(partial["prompt_tokens"]), bool(body.get("return_token_ids"))
    if (by_ids and (partial.get("completion_token_ids") is None or server is None)
            or not by_ids and tagged(partial)):
        return None
    if body["max_tokens"] <= int(partial["completion_tokens"]):  # the limit adds nothing
        return joined(partial, Completion(finish_reason="length", content="",
                                          reasoning_content=None, prompt_tokens=prompt_tokens,
                                          completion_tokens=0,
                                          completion_token_ids=[] if by_ids else None))
    if by_ids and grammar_from_start(body):
        logger.warning("continuation_constrained", consequence="the answer is generated again")
        return None
    try:
        new = await ask(replace(request, partial=partial).body())
    except InputTooLong:  # the prompt and its partial outgrew the context: start again
        logger.warning("continuation_too_long", consequence="the answer is generated again")
        return None
    if new.prompt_tokens <= prompt_tokens:
        logger.warning("continuation_refused", prompt_tokens=new.prompt_tokens,
                       consequence="the answer is generated again")
        return None
    whole = replace(joined(partial, new), prompt_tokens=prompt_tokens)
    return await retexted(whole, body, server) if by_ids and server else whole


async def retexted(whole: Completion, body: dict[str, Any], server: SGLang) -> Completion:
    """The whole answer's texts, made from its ids by the server's tokenizer and split as the
    server splits a straight answer (with SGLang's qwen3 parser, else as stream.finished does
    without one): the new text alone, split by the server from a start that knows nothing of
    the partial, could land on the wrong side of `</think>`."""
    assert whole.completion_token_ids is not None
    # As the answer's own text: SGLang keeps special tokens in it when asked, or for tools.
    tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
    skip = body.get("skip_special_tokens", True) is not False and not tools
    text = await server.detokenize(await untrimmed(whole, server), skip)
    if isinstance(whole.matched_stop, str) and (at := text.find(whole.matched_stop)) != -1:
        text = text[:at]  # SGLang cuts its text at the first match of the stop string
    thinking = thinking_on(body)
    reasoning, content = (parse_reasoning(text, thinking) if await server.reasoning_parser()
                          else split_thinking(text) if thinking else (None, text))
    whole = replace(whole, reasoning_content=reasoning, content=content)
    parser = await server.tool_call_parser() if tools else None
    return await called(whole, body, server, parser) if parser else whole


async def called(whole: Completion, body: dict[str, Any], server: SGLang,
                 parser: str) -> Completion:
    """The whole answer's tool calls, parsed by the server over its whole content (the
    continuation's own calls came from its new text alone: a call begun in the partial was
    lost or garbled), and the content and finish SGLang's chat gives with them: the text
    before the first call, and `tool_calls` for an answer that stopped and called."""
    content, calls = await server.parse_function_call(whole.content, body["tools"], parser)
    finish = whole.finish_reason
    if calls and finish == "stop":
        finish = "tool_calls"
    elif not calls and finish == "tool_calls":
        finish = "stop"
    return replace(whole, content=content, tool_calls=calls or None, finish_reason=finish,
                   matched_stop=None if finish == "tool_calls" else whole.matched_stop)


async def untrimmed(whole: Completion, server: SGLang) -> list[int]:
    """The ids whose text SGLang returns: all but the stop token an answer ended on, which its
    detokenizer drops (the ids keep it, as the real server's do). A `tool_calls` finish no
    longer says what it matched: its last id is that token if the tokenizer skips it."""
    ids = whole.completion_token_ids or []
    stop, last = whole.matched_stop, ids[-1] if ids else None
    if type(stop) is int:
        return ids[:-1] if last == stop else ids
    if (whole.finish_reason == "tool_calls" and stop is None and last is not None
            and await server.detokenize([last], True) == ""):
        return ids[:-1]
    return ids
