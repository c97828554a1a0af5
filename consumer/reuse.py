"""A request answered by a `genq requeue --probe` that ran it already, or by the server.

Looking for a kept answer costs a Redis round trip, and none may sit between a task and its
request (a pivot gives back every running request at once, and the GPU would idle for it).
So the consumer checks whether any answers are kept with each heartbeat, says so in it
(`probe_kept`), and the probe waits until every live consumer has said so before it returns:
a pivot committed after the probe finds every consumer looking."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog

from common.queue import probe_store
from common.sglang.stream import Completion

if TYPE_CHECKING:
    from consumer.worker import Consumer

logger = structlog.get_logger("consumer")


async def refresh(self: Consumer) -> bool:
    """Are probe answers kept? Called with each heartbeat, whose `probe_kept` it becomes."""
    self.probe_kept = bool(await self.r.exists(self.k.probe))
    return self.probe_kept


async def kept_answer(self: Consumer, body: dict[str, Any], index: int) -> Completion | None:
    """The probe's answer to this very request, if one is kept (taken: it is used once)."""
    if not self.probe_kept:
        return None
    stored = await probe_store.take(self.r, self.k, index, body)
    if stored is None:
        return None
    logger.info("probe_answer_reused", completion_tokens=stored["completion_tokens"])
    return Completion(**stored)
