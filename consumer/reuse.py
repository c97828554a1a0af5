"""A request answered by a `genq requeue --probe` that ran it already, or by the server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog

from common import probe_store
from consumer.sglang_stream import Completion

if TYPE_CHECKING:
    from consumer.worker import Consumer

logger = structlog.get_logger("consumer")


async def answer(self: Consumer, body: dict[str, Any], index: int) -> Completion:
    stored = await probe_store.take(self.r, self.k, index, body)
    if stored is not None:
        logger.info("probe_answer_reused", completion_tokens=stored["completion_tokens"])
        return Completion(**stored)
    return await self.server.chat(body, index)
