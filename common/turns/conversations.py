"""`export --format conversations`: the rows drafter pipelines read as they are (SpecForge's
`conversations` column, speculators' prepare-data): `{id, conversations, tools, meta}`, genq's
own fields under the one key `meta`, since SpecForge hands every other column to the chat
template as a keyword. Each message's content is a string (a list of text parts is its text),
so that pyarrow's JSON reader, and so HF datasets, loads every row.

A row is a conversation through its last made turn; with `--per-turn` one row per generation,
its conversation cut after that turn (SpecForge's `train_only_last_turn` recipe: a thinking
template drops earlier turns' reasoning, so each turn is trained in the row where it is last).
A failed conversation (`--include-failed`) is the prompt of the turn that failed, its reason
in `meta`."""

from __future__ import annotations

from typing import Any

from genq.common.turns import splice

Message = dict[str, Any]


def text_of(content: Any) -> str:
    """A message's content as the string a chat template renders: a list of OpenAI content
    parts is its text parts joined by a space, as SGLang joins them for a string template."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content
                        if isinstance(p, dict) and p.get("type", "text") == "text")
    return ""


def as_strings(messages: list[Message]) -> list[Message]:
    """The messages, each content a string; everything else as it is (a spliced tool
    message's tool_call_id and name, a made turn's reasoning_content and tool_calls)."""
    return [{**m, "content": text_of(m.get("content"))} for m in messages]


def _row(prompt: Any, messages: list[Message], meta: dict[str, Any]) -> dict[str, Any]:
    return {"id": prompt.id if prompt.id is not None else prompt.index,
            "conversations": as_strings(messages), "tools": prompt.tools, "meta": meta}


def _meta(prompt: Any, task: int, samples: int, **fields: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"index": prompt.index}
    if samples > 1:
        meta["sample"] = task % samples
    meta.update(fields)
    return meta


def _end(record: dict[str, Any]) -> dict[str, Any]:
    """How a conversation ended, from its last generation's record."""
    return {"ended": record.get("ended"), "stopped": record.get("stopped")}


def whole(prompt: Any, task: int, samples: int, records: list[dict[str, Any]]) -> dict:
    """A done conversation's row: the row's messages through its last made turn, the made
    turns (and the tool answers spliced after them) in place of the row's."""
    made = [splice.message_of(rec) for rec in records]
    messages = splice.prompt(prompt.messages, len(made), made[:-1]) + made[-1:]
    return _row(prompt, messages, _meta(prompt, task, samples, turns=len(made),
                                        **_end(records[-1])))


def per_turn(prompt: Any, task: int, samples: int, records: list[dict[str, Any]],
             done: bool) -> list[dict]:
    """One row per generation, its conversation cut after it; the last of a done
    conversation says how it ended."""
    made = [splice.message_of(rec) for rec in records]
    out = []
    for turn, record in enumerate(records, 1):
        end = _end(record) if done and turn == len(records) else {}
        messages = splice.prompt(prompt.messages, turn, made[:turn - 1]) + [made[turn - 1]]
        out.append(_row(prompt, messages, _meta(prompt, task, samples, turn=turn, **end)))
    return out


def failed(prompt: Any, task: int, samples: int, records: list[dict[str, Any]],
           reason: dict[str, Any]) -> dict:
    """A failed conversation's row: the prompt of the turn it failed at (the turns made before
    it in place), its reason (`status`, `error`, `error_kind`) and the turns made in `meta`."""
    made = [splice.message_of(rec) for rec in records]
    turn = min(len(made) + 1, splice.count(prompt.messages))
    messages = splice.prompt(prompt.messages, turn, made[:turn - 1])
    return _row(prompt, messages, _meta(prompt, task, samples, turns=len(made), **reason))
