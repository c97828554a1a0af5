"""Structured output in the consumer: an answer is checked against its version's JSON Schema
(common/schema.py) as it arrives, before its record is written; one that does not match is
asked again with another seed, up to `schema_retries` times, and then the prompt fails with the
first violation, its last answer kept for `export --include-failed`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
import redis.asyncio as aioredis
import structlog

from genq.common.errors import AnswerInvalid
from genq.common.queue.keys import RunKeys
from genq.common.schema import SCHEMA_RETRIES, checker, schema_of, violation
from genq.common.sglang.stream import Completion

logger = structlog.get_logger("consumer")
T = TypeVar("T")
# A cut answer is reported as truncated, not as invalid; tool calls carry no content to check.
UNCHECKED = ("length", "tool_calls")
# Characters kept of a failed prompt's last answer (content, thinking): enough to see what went
# wrong, bounded because a server that ignores the schema fails every prompt of the run.
KEEP_CHARS = 16_384


class Structured:
    """`retry`: the consumer's Redis retry (through outages, bounded by the shutdown grace)."""

    def __init__(self, client: aioredis.Redis, keys: RunKeys,
                 retry: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]) -> None:
        self.redis, self.keys, self.retry = client, keys, retry
        self.checkers: dict[int, Any] = {}  # version -> its schema's validator, built once

    async def checked(self, answer: Completion, ask: Callable[[dict], Awaitable[Completion]],
                      body: dict[str, Any], params: dict[str, Any], index: int,
                      version: int, seed_of: Callable[[int], int]) -> tuple[Completion, int | None]:
        """(`answer`, None) if it matches (or the version has no schema), else the first of up
        to schema_retries answers asked again that does, with the seed that made it (retry r
        asks with seed_of(r)); AnswerInvalid if none does. Each invalid answer counts in
        invalid|<version> as it arrives."""
        schema = schema_of(params)
        if schema is None:
            return answer, None
        if version not in self.checkers:
            self.checkers[version] = checker(schema)
        retries = int(params.get("schema_retries", SCHEMA_RETRIES))
        seed, counter = None, f"invalid|{version}"
        for retry in range(retries + 1):
            if retry:  # another seed: the same one would sample the same mistake again
                answer = await ask({**body, "seed": (seed := seed_of(retry))})
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
        """The prompt failed on the schema: its last answer kept, the version's count raised,
        in one step."""
        answer = dict(e.answer)
        for field in ("content", "reasoning_content"):
            if len(answer.get(field) or "") > KEEP_CHARS:
                answer[field], answer["cut_at"] = answer[field][:KEEP_CHARS], KEEP_CHARS

        async def keep() -> None:
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(self.keys.invalid, str(e.index), orjson.dumps(answer))
            pipe.hincrby(self.keys.counters, f"schema_failed|{e.answer['params_version']}", 1)
            await pipe.execute()

        await self.retry(keep)
