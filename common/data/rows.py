"""What every data set shares: the chat prompt of a row, the validation that turns a decoded
row into one, and the random-access interface (`Dataset`) that JSON lines and Parquet give."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from genq.common.errors import BadTask, DatasetError
from genq.common.turns import check

FIRST_ROWS = 100  # rows produce reads: enough to tell the data set's shape from one bad row

_EDGE = 1 << 20  # bytes hashed at each end of the file for the fingerprint


@dataclass(frozen=True, slots=True)
class Prompt:
    index: int
    messages: list[dict[str, Any]]
    id: str | int | None = None
    # The row's tool definitions (OpenAI `tools`), sent with the messages: the prompt is both.
    tools: list[dict[str, Any]] | None = None


def _message_ok(m: Any) -> bool:
    """A chat message: a role and content, except that an assistant turn that called tools may
    have empty or null content (a `tool` message answers it)."""
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
        return False
    if m["role"] == "assistant" and isinstance(m.get("tool_calls"), list) and m["tool_calls"]:
        return m.get("content") is None or isinstance(m.get("content"), str | list)
    return "content" in m


def _row_to_prompt(index: int, row: Any) -> Prompt:
    """Validate one decoded row; every defect becomes a BadTask naming the row."""
    if not isinstance(row, dict):
        raise BadTask(index, f"row {index}: not a JSON object")
    row_id = row.get("id")
    if row_id is not None and (isinstance(row_id, bool) or not isinstance(row_id, str | int)):
        raise BadTask(index, f"row {index}: 'id' must be a string or an integer")
    try:
        return _fields_to_prompt(index, row, row_id)
    except BadTask as e:
        e.row_id = row_id
        raise


def _fields_to_prompt(index: int, row: dict[str, Any], row_id: str | int | None) -> Prompt:
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise BadTask(index, f"row {index}: 'tools' is not a list of objects")
    messages = row.get("messages")
    if messages is not None:
        if not (isinstance(messages, list) and messages and all(map(_message_ok, messages))):
            raise BadTask(index, f"row {index}: 'messages' is not a non-empty list of "
                                 "{role, content} objects")
        return Prompt(index, messages, row_id, tools or None)
    prompt = row.get("prompt")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise BadTask(index, f"row {index}: 'prompt' is not a string")
        return Prompt(index, [{"role": "user", "content": prompt}], row_id, tools or None)
    raise BadTask(index, f"row {index}: has neither 'messages' nor 'prompt'")


def edge_digest(fd: int, size: int) -> str:
    """The sha256 of the file's first and last MiB, for the fingerprint."""
    h = hashlib.sha256(os.pread(fd, min(size, _EDGE), 0))
    if size > _EDGE:
        h.update(os.pread(fd, _EDGE, max(_EDGE, size - _EDGE)))
    return h.hexdigest()[:32]


class Dataset:
    """A data set opened for random access; thread-safe ``prompt(index)``."""

    path: Path
    total: int
    fingerprint: str
    version: str | None = None  # an S3 object's ETag; a run pins the one it registered

    def prompt(self, index: int) -> Prompt:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.total:
            raise BadTask(index, f"row {index}: out of range (data set has {self.total} rows)")
        return _row_to_prompt(index, self._row(index))

    def cached(self, index: int) -> bool:
        """Whether prompt(index) is quick (no disk read): an event loop reads it inline, else in
        a thread."""
        return False

    def check_prompts(self) -> None:
        """Refuse, before a run is registered, a data set none of whose rows can be a prompt:
        else every row would fail one by one, or nothing would run."""
        if self.total == 0:
            raise DatasetError(f"data set {self.path}: has no rows")
        if not self._has_prompt_field():
            raise DatasetError(f"data set {self.path}: no row has a 'messages' or 'prompt' "
                               f"{self._field_word}")

    def check_shape(self, conversations: bool) -> None:
        """Refuse (DatasetError, one line) a data set none of whose first rows read as prompts
        genq can make a conversation of (`conversations`: a `--turns all` run; else whose
        `tools` a server takes: `--turns last` sends the rest as the row has it), as a
        benchmark's raw function docs as `tools` would. A row that is not a prompt at all is
        its own fault (it fails alone at its claim), telling nothing of others."""
        first: tuple[int, str] | None = None
        for index in range(min(self.total, FIRST_ROWS)):
            try:
                prompt = self.prompt(index)
            except BadTask:
                continue
            found = check.fault(prompt.messages, prompt.tools) if conversations \
                else check.tools_fault(prompt.tools)
            if found is None:
                return
            first = first or (index, found)
        if first is not None:
            raise DatasetError(f"data set {self.path}: none of its first rows can be sent as "
                               f"a prompt; row {first[0]}: {first[1]}")

    _field_word = "field"

    def _has_prompt_field(self) -> bool:
        """Whether some row may hold `messages` or `prompt` (never False for one that does)."""
        raise NotImplementedError

    def verify(self, expected: str) -> None:
        """Refuse to serve a run registered against another version of the file."""
        if expected != self.fingerprint:
            raise DatasetError(f"data set {self.path} changed since the run was registered "
                               f"(fingerprint {self.fingerprint}, run has {expected})")

    def _row(self, index: int) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
