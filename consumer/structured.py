"""Structured output in the consumer: an answer is checked against its version's JSON Schema
(common/schema.py) as it arrives, before its record is written; one that does not match is
asked again with another seed, up to `schema_retries` times, and then the prompt fails with the
first violation, its last answer kept for `export --include-failed`: in full in the shard's
failed line, and a copy in Redis (RunKeys.invalid) for an export without that shard, cut and
bounded in number, dropped when the prompt ends after all (ack.lua) or fails again (fail.lua)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
import redis.asyncio as aioredis
import structlog

from genq.common.errors import AnswerInvalid, UsageError
from genq.common.queue.keys import RunKeys
from genq.common.queue.scripts import ScriptRunner, invalid_call
from genq.common.schema import SCHEMA_RETRIES, checker, schema_of, violation
from genq.common.sglang.stream import Completion
from genq.common.task import Request

logger = structlog.get_logger("consumer")
T = TypeVar("T")
# A cut answer is reported as truncated, not as invalid; tool calls carry no content to check.
UNCHECKED = ("length", "tool_calls")
# Characters kept in Redis of a failed prompt's last answer (content, thinking), and copies kept
# in all (env GENQ_INVALID_KEEP): enough to see what went wrong, bounded because a server that
# ignores the schema fails every prompt of the run: ~52 MB of Redis at most for ASCII answers
# (measured; 4 bytes a character at worst). The shard keeps the answer whole.
KEEP_CHARS = 2_048
INVALID_KEEP = 10_000


def invalid_keep() -> int:
    """The most copies a run keeps: GENQ_INVALID_KEEP (tests shrink it), else INVALID_KEEP."""
    raw = os.environ.get("GENQ_INVALID_KEEP") or str(INVALID_KEEP)
    try:
        keep = int(raw)
    except ValueError:
        keep = -1
    if keep < 0:
        raise UsageError(f"GENQ_INVALID_KEEP={raw!r}: a number of answers, 0 or more")
    return keep


class Structured:
    """`retry`: the consumer's Redis retry (through outages, bounded by the shutdown grace);
    `keep`: the most answers of failed prompts the run keeps in Redis (invalid_keep())."""

    def __init__(self, client: aioredis.Redis, keys: RunKeys,
                 retry: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]],
                 keep: int | None = None) -> None:
        self.redis, self.keys, self.retry = client, keys, retry
        self.keep = invalid_keep() if keep is None else keep
        self.scripts = ScriptRunner(client)
        self.checkers: dict[int, Any] = {}  # version -> its schema's validator, built once

    async def checked(self, answer: Completion, ask: Callable[[dict], Awaitable[Completion]],
                      again: Callable[[int], Request], params: dict[str, Any], index: int,
                      version: int) -> tuple[Completion, int | None]:
        """(`answer`, None) if it matches (or the version has no schema), else the first of up
        to schema_retries answers asked again that does, with the seed that made it (retry r
        asks again(r), the request under that retry's seed); AnswerInvalid if none does. Each
        invalid answer counts in invalid|<version> as it arrives."""
        schema = schema_of(params)
        if schema is None:
            return answer, None
        if version not in self.checkers:
            self.checkers[version] = checker(schema)
        retries = int(params.get("schema_retries", SCHEMA_RETRIES))
        seed, counter = None, f"invalid|{version}"
        for retry in range(retries + 1):
            if retry:  # another seed: the same one would sample the same mistake again
                request = again(retry)
                seed, answer = request.seed, await ask(request.body())
            if answer.finish_reason in UNCHECKED:
                if answer.finish_reason == "length":  # cut, so not JSON: status says how many
                    await self.retry(lambda: self.redis.hincrby(self.keys.counters,
                                                                f"schema_cut|{version}", 1))
                return answer, seed
            # In a thread: a slow pattern (bounded, common/schema.py) must not hold up the
            # loop that renews leases.
            why = await asyncio.to_thread(violation, answer.content, self.checkers[version])
            if why is None:
                return answer, seed
            await self.retry(lambda: self.redis.hincrby(self.keys.counters, counter, 1))
            logger.info("answer_invalid", violation=why, retry=retry, retries=retries)
        kept = {"params_version": version, "finish_reason": answer.finish_reason,
                "content": answer.content, "reasoning_content": answer.reasoning_content,
                "violation": why}
        raise AnswerInvalid(index, f"{why} ({retries + 1} answers, none matched)", kept)

    async def failed(self, e: AnswerInvalid) -> None:
        """The prompt failed on the schema: the version's count raised and its last answer
        kept, cut, in one step (invalid.lua: not past the run's bound, where it counts as not
        kept, nor for a prompt a redo revived meanwhile)."""
        answer = dict(e.answer)
        for field in ("content", "reasoning_content"):
            if len(answer.get(field) or "") > KEEP_CHARS:
                answer[field], answer["cut_at"] = answer[field][:KEEP_CHARS], KEEP_CHARS
        call = invalid_call(self.keys, e.index, orjson.dumps(answer),
                            int(e.answer["params_version"]), self.keep)
        await self.retry(lambda: self.scripts(call))
