"""What a slot makes of a claimed task: the row's last turn (`last_turn`, one answer), or
under `--turns all` one conversation (a row, or one sample of it), made turn by turn in the slot
that claimed it, so each turn goes to the server that made the turn before and finds its prefix
in the server's cache.

Each made turn but the last is written to the shard, then recorded in Redis
(common/turns/state.py) while the task's lease is ours, in batches with the other slots' made
turns (MadeTurns): a consumer killed mid-conversation costs only the turn in flight, and
whichever consumer claims the task next goes on from the turn after the last recorded one.
The last turn (the row's last, or the one that stopped the conversation) is the task's result,
written by the Committer like any task's, then recorded (its turn.lua call, `Inflight.then`)
and acknowledged.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import redis.asyncio as aioredis
import structlog

from genq.common.data.records import build_record
from genq.common.data.rows import Prompt
from genq.common.data.shards import ShardWriter
from genq.common.errors import BadTask
from genq.common.queue.keys import RunKeys
from genq.common.queue.scripts import Call, ScriptRunner, turn_call
from genq.common.sglang.client import SGLang
from genq.common.sglang.continuation import Partials
from genq.common.sglang.stream import Completion
from genq.common.task import Task
from genq.common.turns import check, splice, state
from genq.common.turns.state import COMPLETE, Standing
from genq.consumer.backoff import ClaimPause
from genq.consumer.commit import MAX_BATCH
from genq.consumer.leases import ACCEPTED, SUPERSEDED, Inflight
from genq.consumer.settings import ConsumeSettings
from genq.consumer.structured import Structured

logger = structlog.get_logger("consumer")
T = TypeVar("T")


class Consumer(Protocol):
    """What the turn loop uses of the consumer (consumer/worker.py), which owns the loop: said
    here, so that this module stands below the worker and the two make no import circle."""

    settings: ConsumeSettings
    redis: aioredis.Redis
    keys: RunKeys
    model: str
    server: SGLang
    sink: ShardWriter
    partials: Partials
    structured: Structured
    clock_offset: float
    stop: asyncio.Event

    pause: ClaimPause

    def retry(self, op: Callable[[], Awaitable[T]]) -> Awaitable[T]: ...
    async def after_abort(self, inflight: Inflight) -> None: ...


async def _ask(c: Consumer, inflight: Inflight, body: dict[str, Any]) -> Completion:
    """The server's answer. A refusal between successes is sent again by this slot after a
    moment, its lease held; one that ends the retries in the slot goes to settle_error."""
    while True:
        try:
            return await c.server.chat(body, inflight.lease.index, on_request=inflight.sent)
        except Exception as e:
            if (wait := c.pause.in_slot(e)) is None:
                raise
        await asyncio.sleep(wait)
        if inflight.abort or c.stop.is_set():  # aborted or stopping while it waited
            inflight.abort = inflight.abort or "shutdown"
            raise asyncio.CancelledError


async def last_turn(c: Consumer, inflight: Inflight, prompt: Prompt, task: Task
                    ) -> tuple[dict[str, Any], Completion] | None:
    """A task of a run that makes one answer a row (`--turns last`): its last turn, asked once
    (or continued from its partial), checked against its version's schema and asked again
    under each retry's seed while it misses; (record, completion) for the Committer, or None if
    it was aborted first."""
    lease = inflight.lease
    messages, turn = splice.last(prompt.messages)
    if not messages:
        raise unpromptable(prompt.index)
    request = task.request(messages, c.model, prompt.tools)
    if inflight.abort or c.stop.is_set():
        # Claimed while the stop came (or aborted before its request existed): a request
        # started now would outlive the grace by a whole generation.
        inflight.abort = inflight.abort or "shutdown"
        await c.after_abort(inflight)
        return None
    ask = functools.partial(_ask, c, inflight)
    completion = await c.partials.answer(lease.index, lease.version, request, ask, c.server) \
        or await ask(request.body())
    completion, seed = await c.structured.checked(
        completion, ask, lambda retry: task.request(messages, c.model, prompt.tools, retry=retry),
        task.params, lease.index, lease.version)
    record = build_record(
        run=c.settings.run, task=task.id(turn), samples=task.samples, prompt_id=prompt.id,
        version=lease.version, attempt=lease.attempt, server=c.settings.server_id,
        model=c.model, completion=completion, latency_s=time.monotonic() - inflight.started,
        gen=lease.gen, clock_offset=c.clock_offset,
        seed=request.seed if seed is None else seed)
    return record, completion


def unpromptable(index: int) -> BadTask:
    """A row of one assistant message: its turn has nothing to be made from (either --turns)."""
    return BadTask(index, f"row {index}: its only message is an assistant turn: there is no "
                   "prompt to make it anew from")


class Conversations:
    def __init__(self, consumer: Consumer) -> None:
        self.c = consumer
        self.turns = MadeTurns(consumer)

    async def make(self, inflight: Inflight, prompt: Prompt, task: Task
                   ) -> tuple[dict[str, Any], Completion] | None:
        """The conversation's last turn (record, completion) for the Committer; None if it
        ended otherwise: given back at a stop (its made turns stay), or its lease lost."""
        c, lease, row = self.c, inflight.lease, prompt.messages
        if (fault := check.fault(row, prompt.tools)) is not None:  # before it costs a request
            raise BadTask(prompt.index, f"row {prompt.index}: {fault}")
        count = splice.count(row)
        # Only a conversation with made turns kept reads them (claim.lua says which).
        standing = await c.retry(lambda: state.resume(c.redis, c.keys, lease.index,
                                                      lease.version)) if lease.kept \
            else Standing()
        made, messages = standing.made[:count - 1], standing.messages[:count - 1]
        fig = standing.fig  # the made turns' sums, for status (turn.lua)
        if made:
            logger.debug("conversation_resumed", turn=len(made) + 1, of=count)
        ids: list[int] | None = None  # the turn before's prompt + completion ids, if known
        ask, first = functools.partial(_ask, c, inflight), len(made) + 1
        at = splice.assistant_turns(row)
        before = splice.prompt(row, first, messages)  # then extended turn by turn
        for turn in range(first, count + 1):
            if not before:
                raise unpromptable(prompt.index)
            if inflight.abort or c.stop.is_set():  # between turns: the made ones are kept
                inflight.abort = inflight.abort or "shutdown"
                await c.after_abort(inflight)
                return None
            request = task.request(before, c.model, prompt.tools, turn=turn)
            asked = time.monotonic()
            # `requeue --continue`: the turn it was cut at goes on from its partial.
            continued = await c.partials.answer(lease.index, lease.version, request, ask,
                                                c.server, turn) if turn == first else None
            completion = continued or await ask(request.body())
            kept = (completion.continued_from or {}).get("tokens", 0)  # not decoded again
            record = build_record(
                run=c.settings.run, task=task.id(turn), samples=task.samples,
                prompt_id=prompt.id, version=lease.version, attempt=lease.attempt,
                server=c.settings.server_id, model=c.model, completion=completion,
                latency_s=time.monotonic() - asked, gen=lease.gen, clock_offset=c.clock_offset,
                seed=request.seed)
            unstable, checked = _boundary(ids, row, turn, completion)
            if completion.prompt_token_ids is not None \
                    and completion.completion_token_ids is not None:
                ids = [*completion.prompt_token_ids, *completion.completion_token_ids]
            # A continued turn's entry keeps its partial's tokens: turn.lua takes its count
            # back if a redo of all sets it aside.
            entry = [lease.version, lease.attempt, *([kept] if kept else [])]
            follow = splice.after(row, turn, completion.finish_reason, completion.tool_calls,
                                  at) if turn < count else None
            if follow is None or isinstance(follow, splice.Stop):
                if isinstance(follow, splice.Stop):
                    record.update(stopped=follow.reason, stopped_detail=follow.detail)
                end = splice.TRUNCATED if completion.finish_reason == "length" else (
                    follow.reason if follow else
                    splice.UNANSWERED if completion.tool_calls else COMPLETE)
                record["ended"] = end  # the conversation's last generation: recover finds it
                # Recorded by the Committer once written, just before its ack (consumer/commit.py).
                inflight.then = self.call(inflight, Standing(made, end=end, last=turn, fig=fig),
                                          b"", unstable, checked, 0, record=record)
                return record, completion
            message = splice.message_of(record)
            made, messages = [*made, entry], [*messages, message]
            before = splice.extend(row, turn, before, message, follow, at)
            fig = state.counted(fig, completion.prompt_tokens, completion.completion_tokens,
                                completion.cached_tokens or 0, completion.finish_reason)
            if not await self.record(inflight, Standing(made, fig=fig), state.pack(messages),
                                     unstable, checked, max(1, completion.completion_tokens
                                                            - kept), kept, record):
                return None
        raise AssertionError("unreachable: the last turn returns")  # pragma: no cover

    async def record(self, inflight: Inflight, standing: Standing, messages: bytes,
                     unstable: int, checked: int, tokens: int, continued: int = 0,
                     made: dict[str, Any] | None = None) -> bool:
        """turn.lua: where the conversation stands, iff its lease is ours, after the `made`
        turn's record (a turn before its last) is written; `tokens` of a turn before its last
        count in the rate, and one `continued` from a partial of that many tokens counts as
        continued (its partial is dropped: ack.lua drops the last's)."""
        call = self.call(inflight, standing, messages, unstable, checked, tokens, continued,
                         record=made)
        outcome = await self.turns.commit(made, call)
        if outcome == ACCEPTED:
            return True
        if outcome == SUPERSEDED:  # finished under old parameters after an aborting switch
            inflight.abort = inflight.abort or "parameters changed"
            await self.c.after_abort(inflight)
            return False
        logger.warning("lease_lost", reason="lease expired; the conversation was handed out "
                       "again", turn=len(standing.made) + 1)
        return False

    def call(self, inflight: Inflight, standing: Standing, messages: bytes, unstable: int,
             checked: int, tokens: int, continued: int = 0, *,
             record: dict[str, Any] | None) -> Call:
        """turn.lua's call for the made turn `record`."""
        lease, c = inflight.lease, self.c
        return turn_call(c.keys, lease.job_id, lease.index, lease.exec_id, standing.encode(),
                         messages, len(standing.made), standing.ended(), unstable, checked,
                         tokens, c.settings.server_id, continued, lease.version,
                         record["created_at"] if record else None)


class MadeTurns:
    """The made turns of every slot, written together (one write and fdatasync) and recorded
    together (one Redis round trip), as the Committer batches tasks' last turns: a turn costs
    a share of a disk sync and a round trip, not one of each. Each is recorded only once the
    batch holding it is on disk; a slot waits for its own."""

    def __init__(self, consumer: Consumer) -> None:
        self.c = consumer
        self.scripts = ScriptRunner(consumer.redis)
        self.pending: list[tuple[dict[str, Any] | None, Call, asyncio.Future[int]]] = []
        self.flushing: asyncio.Task[None] | None = None

    async def commit(self, record: dict[str, Any] | None, call: Call) -> int:
        """Write `record` (if any), then run `call`: turn.lua's outcome (leases.ACCEPTED,
        SUPERSEDED, or REFUSED: the lease was lost)."""
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.pending.append((record, call, done))
        if self.flushing is None or self.flushing.done():
            # Its own task: a slot cancelled while it waits leaves the others' batch whole.
            self.flushing = asyncio.create_task(self.flush())
        return await done

    async def run(self, calls: list[Call]) -> list[int]:
        """Recorded calls of turns already written (the Committer's last turns), in one round
        trip."""
        return await self.c.retry(functools.partial(self.scripts.pipelined, self.c.redis, calls))

    async def flush(self) -> None:
        await asyncio.sleep(0)  # the turns that finished in this turn of the loop join
        while self.pending:
            batch, self.pending = self.pending[:MAX_BATCH], self.pending[MAX_BATCH:]
            try:
                records = [record for record, _, _ in batch if record is not None]
                if records:
                    await asyncio.to_thread(self.c.sink.write_many, records)
                calls = [call for _, call, _ in batch]
                outcomes = await self.c.retry(
                    functools.partial(self.scripts.pipelined, self.c.redis, calls))
            except asyncio.CancelledError:
                for _, _, done in [*batch, *self.pending]:
                    done.cancel()
                raise
            except Exception as e:  # each slot raises it: the disk's trouble, Redis gone
                for _, _, done in batch:
                    if not done.done():
                        done.set_exception(e)
                continue
            for (_, _, done), ok in zip(batch, outcomes, strict=True):
                if not done.done():
                    done.set_result(int(ok))


def _boundary(ids: list[int] | None, row: list[dict[str, Any]], turn: int,
              completion: Completion) -> tuple[int, int]:
    """(unstable, checked): inside a tool chain the template renders the turn before unchanged,
    so this turn's prompt ids begin with the turn before's prompt and completion ids; a turn
    whose do not is counted (after speculators' BoundaryUnstableError), never hidden."""
    now = completion.prompt_token_ids
    if ids is None or now is None or not splice.tool_chain(row, turn):
        return 0, 0
    return int(now[:len(ids)] != ids), 1
