"""The output record: one JSON object per completed prompt, as shards and export write it;
where a run's shard files are, and how one line of them reads back."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from genq.common.errors import reason_kind
from genq.common.task import TaskId


def shard_files(out_dir: str | os.PathLike[str], run: str) -> list[Path]:
    """The run's shards in one directory, by name (never its `{run}.manifest.json`)."""
    return sorted(Path(out_dir).glob(f"{run}.*.jsonl"))


def unheld_shards(out_dir: str | os.PathLike[str], run: str, mode: int,
                  lock: int) -> Iterator[tuple[Path, int]]:
    """(path, fd opened with `mode`, `lock` taken) of each of the run's shards no live writer
    holds; the fd closes when the next is asked for."""
    for path in shard_files(out_dir, run):
        try:
            fd = os.open(path, mode)
        except FileNotFoundError:
            continue  # shipped and removed since the directory was listed
        try:
            fcntl.flock(fd, lock | fcntl.LOCK_NB)
            yield path, fd
        except BlockingIOError:
            pass  # a live writer holds it: its tail is in progress, not torn
        finally:
            os.close(fd)


def parse_line(line: bytes) -> dict[str, Any] | None:
    """A shard line's record; None for a torn line (no newline: never acknowledged) or one not a
    JSON object."""
    if not line.endswith(b"\n"):
        return None
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def build_record(*, run: str, task: TaskId, samples: int, prompt_id: Any, version: int,
                 attempt: int, server: str, model: str, completion: Any, latency_s: float,
                 gen: int = 0, clock_offset: float = 0.0,
                 seed: int | None = None) -> dict[str, Any]:
    """task: whom the answer is for, its row as `index`, its `sample` in a run of several
    `samples` a prompt, and its `turn`; clock_offset: Redis's clock less this host's, so that
    created_at is by Redis's clock; seed: the request's, named where it is not the run's own."""
    record: dict[str, Any] = {"index": task.row}
    if prompt_id is not None:
        record["id"] = prompt_id
    if samples > 1:
        record["sample"] = task.sample
    if seed is not None:
        record["seed"] = seed
    record["turn"] = task.turn
    record.update(run=run, params_version=version, attempt=attempt)
    if gen:  # claimed after a `genq recover`: tells this attempt from one claimed before it
        record["gen"] = gen
    record.update(finish_reason=completion.finish_reason, prompt_tokens=completion.prompt_tokens,
                  completion_tokens=completion.completion_tokens,
                  reasoning_content=completion.reasoning_content, content=completion.content,
                  server=server, model=model, latency_s=round(latency_s, 3),
                  created_at=round(time.time() + clock_offset, 3))
    if getattr(completion, "cached_tokens", None) is not None:  # the server reported its cache
        record["cached_tokens"] = completion.cached_tokens
    if getattr(completion, "max_tokens", None):  # lowered to fit the model's context
        record["max_tokens_used"] = completion.max_tokens
    if getattr(completion, "completion_token_ids", None) is not None:  # a --token-ids run
        record["prompt_token_ids"] = completion.prompt_token_ids
        record["completion_token_ids"] = completion.completion_token_ids
    if getattr(completion, "tool_calls", None):  # the server parsed tool calls out of the text
        record["tool_calls"] = completion.tool_calls
    if getattr(completion, "continued_from", None):  # `requeue --continue`: the partial's key
        record["continued_from"] = completion.continued_from
    return record


FAILED = "failed"  # a failed task's line: its `status`


def failed_record(*, run: str, task: int, samples: int, error: str,
                  answer: dict[str, Any] | None = None, prompt_id: Any = None,
                  version: int | None = None, attempt: int = 0, server: str = "", gen: int = 0,
                  clock_offset: float = 0.0) -> dict[str, Any]:
    """A failed task's line, the one shape `export --include-failed` writes: its reason
    (`error`; Redis keeps only its kind), a prompt failed on the schema its last `answer`.
    The consumer also says the row's id and which claim failed (`version` on); export, making
    one from Redis, knows none of that. Never a result (``is_failure``)."""
    record: dict[str, Any] = {"index": task // samples}
    if samples > 1:  # the task is row index, sample (task_of)
        record["sample"] = task % samples
    if prompt_id is not None:
        record["id"] = prompt_id
    record.update(run=run, status=FAILED, error=error, error_kind=reason_kind(error))
    if version is not None:
        record.update(params_version=version, attempt=attempt, **({"gen": gen} if gen else {}),
                      server=server, created_at=round(time.time() + clock_offset, 3))
    if answer is not None:
        record["answer"] = answer
    return record


def is_failure(record: dict[str, Any]) -> bool:
    """Whether a shard line's record is a failed task's (``failed_record``), not a result."""
    return record.get("status") == FAILED
