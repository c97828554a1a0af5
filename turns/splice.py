"""A turn, the unit of a conversation: turn k is a row's k-th assistant message (1-based), its
prompt the messages before it, and whether a regenerated turn lets the row's next ones follow.

Pure functions of a row's messages; the consumer builds its request from them
(docs/REFERENCE.md, "Turns").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

Message = dict[str, Any]
# A run's --turns: LAST makes one answer a row (its final assistant turn, or the next); ALL
# makes every assistant turn in order (turns/engine.py).
LAST, ALL = "last", "all"
DIVERGED, TRUNCATED = "diverged", "truncated"  # why a conversation stopped before its end


@dataclass(frozen=True)
class Stop:
    """A conversation ends at this turn: `reason` DIVERGED or TRUNCATED, `detail` says more."""

    reason: str
    detail: str = ""


def assistant_turns(messages: Sequence[Message]) -> list[int]:
    """Where each assistant turn is: turn k is messages[assistant_turns(messages)[k - 1]]."""
    return [at for at, m in enumerate(messages) if m.get("role") == "assistant"]


def count(messages: Sequence[Message]) -> int:
    """How many turns `--turns all` makes of a row: its assistant turns, plus the answer to a
    row that ends with a user or tool message."""
    at = assistant_turns(messages)
    return len(at) if at and at[-1] == len(messages) - 1 else len(at) + 1


def message_of(record: dict[str, Any]) -> Message:
    """A made turn as the next turn's prompt holds it: the record's content, reasoning_content
    and tool_calls (what the chat template may render of an assistant message)."""
    message: Message = {"role": "assistant", "content": record.get("content")}
    if record.get("reasoning_content"):
        message["reasoning_content"] = record["reasoning_content"]
    if record.get("tool_calls"):
        message["tool_calls"] = record["tool_calls"]
    return message


def tool_chain(messages: Sequence[Message], turn: int) -> bool:
    """Whether only tool results stand between turn `turn` and the one before it: the template
    then renders the turn before unchanged, so this turn's prompt ids begin with its ids."""
    at = assistant_turns(messages)
    if not 1 < turn <= len(at) + 1:
        return False
    between = messages[at[turn - 2] + 1:at[turn - 1] if turn <= len(at) else len(messages)]
    return bool(between) and all(m.get("role") == "tool" for m in between)


def prompt(messages: Sequence[Message], turn: int,
           before: Sequence[Message]) -> list[Message]:
    """Turn `turn`'s prompt messages: the row's system, user and tool messages before it, with
    `before[i]` in place of assistant turn i + 1 (the regenerated turns: content,
    reasoning_content, tool_calls). A turn past the row's last assistant turn is the answer to
    all of it. The row's `tools` go beside these, unchanged."""
    at = assistant_turns(messages)
    if len(before) != turn - 1:
        raise ValueError(f"turn {turn} needs the {turn - 1} turns before it, not {len(before)}")
    end = at[turn - 1] if turn <= len(at) else len(messages)
    given = iter(before)
    return [next(given) if m.get("role") == "assistant" else m for m in messages[:end]]


def last(messages: Sequence[Message]) -> tuple[list[Message], int]:
    """`--turns last`: (the prompt, the turn it makes). A row ending with an assistant turn has
    that turn made anew, so genq never answers after an answer; one ending with a user or tool
    message is answered whole, as its next turn."""
    at = assistant_turns(messages)
    turn = count(messages)
    return prompt(messages, turn, [messages[i] for i in at[:turn - 1]]), turn


def _names(calls: Sequence[Message] | None) -> Counter[str]:
    return Counter(str((c.get("function") or {}).get("name")) for c in calls or ())


def after(messages: Sequence[Message], turn: int, finish_reason: str | None,
          tool_calls: Sequence[Message] | None) -> list[Message] | Stop:
    """What follows regenerated turn `turn`: the row's tool messages that answered the original
    turn (spliced in unchanged, since tools are not run), when the regenerated calls name the
    same tools in the same number; otherwise a Stop. A turn cut at max_tokens stops the
    conversation, since the next turn needs its end."""
    if finish_reason == "length":
        return Stop(TRUNCATED, f"turn {turn} reached max_tokens")
    for call in tool_calls or ():
        if not _object(call.get("function") or {}):
            name = (call.get("function") or {}).get("name")
            return Stop(DIVERGED, f"turn {turn} called {name} with arguments that are not a "
                        "JSON object")
    at = assistant_turns(messages)[turn - 1]
    made, asked = _names(tool_calls), _names(messages[at].get("tool_calls"))
    if made != asked:
        return Stop(DIVERGED, f"turn {turn} called {_said(made)}; the row's called {_said(asked)}")
    answers = []
    for m in messages[at + 1:]:
        if m.get("role") != "tool":
            break
        answers.append(m)
    return answers


def _object(function: Message) -> bool:
    """Whether a call's arguments are a JSON object: the one shape a server takes back in the
    next turn's prompt (SGLang refuses `""`, which a named tool_choice without `strict` makes)."""
    arguments = function.get("arguments")
    if isinstance(arguments, dict):
        return True
    try:
        return isinstance(orjson.loads(arguments or ""), dict)
    except orjson.JSONDecodeError:
        return False


def _said(names: Counter[str]) -> str:
    return ", ".join(f"{name} × {n}" for name, n in sorted(names.items())) or "no tool"
