"""Whether genq can make a prompt of a row's conversation, checked before the row costs a
request: `fault` names the first thing wrong, by message and field. The consumer of a
`--turns all` run fails such a row alone, at its claim (consumer/turns.py); `genq produce`
refuses a data set whose first rows all have one (Dataset.check_shape): then the data set's shape is
wrong (e.g. a benchmark's raw function docs as `tools`), not one row.

A call the row has no result for is no fault: the conversation stops there (splice.after).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_SHAPE = '{"type": "function", "function": {"name": ..., "parameters": ...}}'


def fault(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None) -> str | None:
    """The row's first fault, or None. `messages` are {role, ...} objects and `tools` a list of
    objects or None, as common/data/rows.py reads a row."""
    if (bad := tools_fault(tools)) is not None:
        return bad
    unanswered = 0  # the calls of the last assistant message no tool message answered yet
    for at, message in enumerate(messages):
        role = message["role"]
        if role not in ROLES:
            return f"message {at}: unknown role {role!r} (not one of {', '.join(ROLES)})"
        if role == "tool":
            if not unanswered:
                return f"message {at}: a tool result with no call before it to answer"
            unanswered -= 1
        elif role == "assistant":
            calls = message.get("tool_calls")
            if (bad := calls_fault(at, calls, tools)) is not None:
                return bad
            unanswered = len(calls or ())
        else:
            unanswered = 0
    return None


def tools_fault(tools: Sequence[Any] | None) -> str | None:
    """Why the row's `tools` are not OpenAI function tools, the shape the server takes."""
    for at, tool in enumerate(tools or ()):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            return f"'tools'[{at}] is not an OpenAI function tool ({TOOL_SHAPE})"
    return None


def calls_fault(at: int, calls: Any, tools: Sequence[Any] | None) -> str | None:
    """Why assistant message `at`'s `tool_calls` cannot be sent back in a prompt."""
    if calls is None:
        return None
    if not isinstance(calls, list):
        return f"message {at}: 'tool_calls' is {_kind(calls)}, not a list"
    if calls and not tools:
        return f"message {at} calls tools but the row has no 'tools'"
    for n, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return f"message {at}: tool_calls[{n}] has no function name ({{'function': " \
                   "{'name', 'arguments'}})"
        if arguments(function) is None:
            return f"message {at}: tool_calls[{n}].function.arguments is not a JSON object"
    return None


def arguments(function: dict[str, Any]) -> dict[str, Any] | None:
    """A call's arguments as an object, or None if they are not a JSON object: the one shape a
    server takes back in a prompt (SGLang refuses `""`, which a named tool_choice without
    `strict` makes)."""
    value = function.get("arguments")
    if isinstance(value, dict):
        return value
    try:
        value = orjson.loads(value or "")
    except (orjson.JSONDecodeError, TypeError):
        return None
    return value if isinstance(value, dict) else None


def _kind(value: Any) -> str:
    names: dict[type, str] = {dict: "an object", str: "a string"}
    return names.get(type(value), type(value).__name__)
