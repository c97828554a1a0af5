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

from genq.common.turns import check

Message = dict[str, Any]
# Why a conversation stopped before its end: a made turn unlike the row's, one cut at
# max_tokens, or a made call the row has no result for.
DIVERGED, TRUNCATED, UNANSWERED = "diverged", "truncated", "unanswered"


@dataclass(frozen=True)
class Stop:
    """A conversation ends at this turn: `reason` DIVERGED, TRUNCATED or UNANSWERED, `detail`
    says more."""

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
    reasoning_content, tool_calls), each made call followed by the row's result for it
    (`after`). A turn past the row's last assistant turn is the answer to all of it. The row's
    `tools` go beside these, unchanged."""
    at = assistant_turns(messages)
    if len(before) != turn - 1:
        raise ValueError(f"turn {turn} needs the {turn - 1} turns before it, not {len(before)}")
    end = at[turn - 1] if turn <= len(at) else len(messages)
    out = list(messages[:at[0] if at else end])
    for n, made in enumerate(before):
        rest = messages[at[n] + 1:at[n + 1] if n + 1 < len(at) else len(messages)]
        results = _results(messages, at[n])
        spliced = _spliced(messages, at[n], n + 1, made.get("tool_calls"))
        # A made turn `after` let through always matches; else the row's own results stay.
        out += [made, *(spliced if isinstance(spliced, list) else results),
                *rest[len(results):]]
    return out


def extend(messages: Sequence[Message], turn: int, before: Sequence[Message], made: Message,
           follow: Sequence[Message], at: Sequence[int] | None = None) -> list[Message]:
    """Turn `turn + 1`'s prompt from turn `turn`'s (`before`), its made turn `made` and the
    results `after` let through (`follow`): what `prompt` gives, in one step rather than
    splicing every turn before again. `at`: the row's assistant_turns, if known."""
    at = assistant_turns(messages) if at is None else at
    rest = messages[at[turn - 1] + 1:at[turn] if turn < len(at) else len(messages)]
    return [*before, made, *follow, *rest[len(_results(messages, at[turn - 1])):]]


def last(messages: Sequence[Message]) -> tuple[list[Message], int]:
    """`--turns last`: (the prompt, the turn it makes): the row as it is, up to that turn. A
    row ending with an assistant turn has that turn made anew, so genq never answers after an
    answer; one ending with a user or tool message is answered whole, as its next turn."""
    at = assistant_turns(messages)
    turn = count(messages)
    return list(messages[:at[turn - 1] if turn <= len(at) else len(messages)]), turn


def after(messages: Sequence[Message], turn: int, finish_reason: str | None,
          tool_calls: Sequence[Message] | None, at: Sequence[int] | None = None
          ) -> list[Message] | Stop:
    """What follows regenerated turn `turn`: the row's results for its calls (tools are not
    run), when they call the same tools as the row's turn, as many times; otherwise a Stop. A
    turn cut at max_tokens stops the conversation, since the next turn needs its end; so does
    a call the row has no result for. `at`: the row's assistant_turns, if known."""
    if finish_reason == "length":
        return Stop(TRUNCATED, f"turn {turn} reached max_tokens")
    for call in tool_calls or ():
        if check.arguments(call.get("function") or {}) is None:
            name = (call.get("function") or {}).get("name")
            return Stop(DIVERGED, f"turn {turn} called {name} with arguments that are not a "
                        "JSON object")
    at = assistant_turns(messages) if at is None else at
    return _spliced(messages, at[turn - 1], turn, tool_calls)


def _spliced(messages: Sequence[Message], at: int, turn: int,
             calls: Sequence[Message] | None) -> list[Message] | Stop:
    """The row's results (tool messages after assistant message `at`, the row's turn `turn`)
    for the made `calls`, in their order, each carrying its call's id and name: a made call
    gets the result of the row's call of its name (among calls of one name, the one with the
    same arguments where they match, else the next in order)."""
    asked = messages[at].get("tool_calls") or []
    made, names = _names(calls), _names(asked)
    if made != names:
        return Stop(DIVERGED, f"turn {turn} called {_said(made)}; the row's called {_said(names)}")
    results, out = _answered(asked, _results(messages, at)), []
    for call, row_call in zip(calls or (), _match(calls or (), asked), strict=True):
        result = results[row_call]
        if result is None:
            return Stop(UNANSWERED, f"turn {turn} called {_name(call)}; the row has no result "
                        "for it")
        out.append({**result, **({"tool_call_id": call["id"]} if call.get("id") else {}),
                    "name": _name(call)})
    return out


def _results(messages: Sequence[Message], at: int) -> list[Message]:
    """The tool messages right after message `at`."""
    out = []
    for m in messages[at + 1:]:
        if m.get("role") != "tool":
            break
        out.append(m)
    return out


def _answered(calls: Sequence[Message], results: Sequence[Message]) -> list[Message | None]:
    """Each of the row's calls' result: the one naming its id, else the next unclaimed in
    order; None where the row has none."""
    ids = [call.get("id") for call in calls]
    out: list[Message | None] = [None] * len(calls)
    unnamed = []
    for result in results:
        named = [n for n, i in enumerate(ids) if i is not None and i == result.get("tool_call_id")
                 and out[n] is None]
        if named:
            out[named[0]] = result
        else:
            unnamed.append(result)
    rest = iter(unnamed)
    return [result if result is not None else next(rest, None) for result in out]


def _match(made: Sequence[Message], asked: Sequence[Message]) -> list[int]:
    """For each made call, which of the row's calls (of as many of each name) it is: the same
    name and arguments first, then the same name, in order."""
    if len(made) == 1 == len(asked):  # a tool chain's one call: its arguments decide nothing
        return [0]
    free, out = list(range(len(asked))), [-1] * len(made)
    for same_arguments in (True, False):
        for n, call in enumerate(made):
            for row_call in free if out[n] < 0 else ():
                if _name(asked[row_call]) == _name(call) and (not same_arguments or _arguments(
                        asked[row_call]) == _arguments(call)):
                    out[n] = row_call
                    free.remove(row_call)
                    break
    return out


def _name(call: Message) -> str:
    return str((call.get("function") or {}).get("name"))


def _arguments(call: Message) -> dict[str, Any] | None:
    return check.arguments(call.get("function") or {})


def _names(calls: Sequence[Message] | None) -> Counter[str]:
    return Counter(map(_name, calls or ()))


def _said(names: Counter[str]) -> str:
    return ", ".join(f"{name} × {n}" for name, n in sorted(names.items())) or "no tool"
