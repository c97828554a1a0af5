"""The output record: one JSON object per completed prompt, as shards and export write it."""

from __future__ import annotations

import time
from typing import Any


def build_record(*, run: str, index: int, prompt_id: Any, version: int, attempt: int,
                 server: str, model: str, completion: Any, latency_s: float) -> dict[str, Any]:
    record: dict[str, Any] = {"index": index}
    if prompt_id is not None:
        record["id"] = prompt_id
    record.update(
        run=run,
        params_version=version,
        attempt=attempt,
        finish_reason=completion.finish_reason,
        prompt_tokens=completion.prompt_tokens,
        completion_tokens=completion.completion_tokens,
        reasoning_content=completion.reasoning_content,
        content=completion.content,
        server=server,
        model=model,
        latency_s=round(latency_s, 3),
        created_at=round(time.time(), 3),
    )
    if getattr(completion, "max_tokens", None):  # lowered to fit the model's context
        record["max_tokens_used"] = completion.max_tokens
    return record
