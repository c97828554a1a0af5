"""The simulator's toy tokenizer and its Qwen3-shaped chat template.

Text splits into pieces: the special markers, runs of newlines, and words with the spaces
before them. A piece of the simulator's own vocabulary (its answer words, the roles, the
newlines) has a fixed id; any other piece gets an id from a hash of its text, the same in
every process (remembered, so that a short text encoded here decodes back). Specials carry
Qwen3's ids, so the ids look like a Qwen3 model's to a client."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import orjson

IM_START, IM_END = 151644, 151645
THINK_OPEN, THINK_CLOSE = 151667, 151668
# Qwen's tool-call tags: added tokens, kept in the text like the think tags.
CALL_OPEN, CALL_CLOSE = 151657, 151658
SPECIALS = {"<|im_start|>": IM_START, "<|im_end|>": IM_END, "<think>": THINK_OPEN,
            "</think>": THINK_CLOSE, "<tool_call>": CALL_OPEN, "</tool_call>": CALL_CLOSE}
# Qwen's own ids for the newlines; the rest of the fixed vocabulary sits below HASHED_FROM.
VOCAB = {"\n": 198, "\n\n": 271, "hmm": 1001, " hmm": 1002, "ok": 1003, " ok": 1004,
         "assistant": 1005, "user": 1006, "system": 1007, "tool": 1008}
HASHED_FROM, HASHED_SPAN = 2000, 148000
# Hashed pieces remembered for decoding: enough for any test's texts, bounded so a long
# benchmark of distinct prompts does not grow the table without end.
REMEMBER = 200_000
# Pieces: a special, a run of newlines, spaces then a word, or trailing spaces.
_SPECIAL = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
_PIECE = re.compile(r"\n+|[^\S\n]*\S+|[^\S\n]+")
_DECODE = {i: s for s, i in {**SPECIALS, **VOCAB}.items()}
# Hashed pieces of the simulator's own answers (a tool call's name and arguments): they decode
# as written whatever prompt piece came first with the same id, full table or not. Few: the
# requests' tool names and the calls' word counts.
_ANSWER: dict[int, str] = {}
# The prompt ends with the generation prompt; the model's answer follows it.
GENERATION = (IM_START, VOCAB["assistant"], VOCAB["\n"])
# Qwen3's template writes an empty thinking block there when thinking is switched off.
NO_THINK = (THINK_OPEN, VOCAB["\n\n"], THINK_CLOSE, VOCAB["\n\n"])


def piece_id(piece: str, answer: bool = False) -> int:
    known = SPECIALS.get(piece) or VOCAB.get(piece)
    if known:
        return known
    digest = hashlib.sha256(piece.encode()).digest()
    token = HASHED_FROM + int.from_bytes(digest[:8], "big") % HASHED_SPAN
    if answer:
        _ANSWER[token] = piece  # two answer pieces of one id: the latest wins, a toy's limit
    elif len(_DECODE) < REMEMBER:
        _DECODE.setdefault(token, piece)  # a collision keeps the first piece: a toy's limit
    return token


def encode(text: str, answer: bool = False) -> list[int]:
    """Text to ids. `decode(encode(text)) == text` always for the simulator's own vocabulary
    and for a text encoded as an `answer` (a tool call's); other text decodes back only while
    its pieces' hashed ids do not collide (thousands of distinct words will) and the table has
    room: the simulator never needs to decode a prompt, only its answers."""
    ids: list[int] = []
    for n, part in enumerate(_SPECIAL.split(text)):
        if n % 2:
            ids.append(SPECIALS[part])
        else:
            ids.extend(piece_id(p, answer) for p in _PIECE.findall(part))
    return ids


def decode(ids: list[int], skip_special: bool = False) -> str:
    """Ids to text; SGLang leaves the stop token out of the text it returns."""
    return "".join("" if (skip_special and i in (IM_START, IM_END))
                   else _ANSWER.get(i) or _DECODE.get(i, "") for i in ids)


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        # OpenAI content parts: only the text parts count toward the prompt.
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _last_query(messages: list[dict[str, Any]]) -> int:
    """Where Qwen3's template says the last user query is: the last user message that is not a
    tool's answer in a <tool_response> wrapper (none: the last message)."""
    for at in range(len(messages) - 1, -1, -1):
        text = messages[at].get("content")
        if messages[at].get("role") == "user" and isinstance(text, str) and not (
                text.startswith("<tool_response>") and text.endswith("</tool_response>")):
            return at
    return len(messages) - 1


def _assistant(message: dict[str, Any], keep_thinking: bool) -> str:
    """An assistant turn of the history as Qwen3's template renders it: its reasoning (sent as
    reasoning_content, or inside <think> in content) kept only after the last user query,
    inside the tool chain the model is still working through, and dropped before it; then its
    calls, each on a line of its own after any content."""
    content, reasoning = _content(message), message.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = ""
        if "</think>" in content:
            parts = content.split("</think>")
            reasoning = parts[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = parts[-1].lstrip("\n")
    text = content
    if keep_thinking and reasoning:
        thought, answer = reasoning.strip("\n"), content.lstrip("\n")
        text = f"<think>\n{thought}\n</think>\n\n{answer}"
    calls = message.get("tool_calls")
    for n, call in enumerate(calls if isinstance(calls, list) else ()):
        function = call.get("function", call) if isinstance(call, dict) else {}
        arguments = function.get("arguments", {}) if isinstance(function, dict) else {}
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)  # the template's tojson
        name = function.get("name", "") if isinstance(function, dict) else ""
        text += ("\n" if n or content else "") + (
            f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>')
    return text


def _tools_block(tools: list[Any]) -> str:
    """Qwen3's system-prompt tools section: a row with tools has other prompt ids."""
    lines = "\n".join(orjson.dumps(t, option=orjson.OPT_SORT_KEYS).decode() for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"<tools>\n{lines}\n</tools>")


def render(messages: list[dict[str, Any]], tools: Any, thinking: bool,
           prefix: str | None = None) -> list[int]:
    """The prompt ids of a chat request: each message as `<|im_start|>role\\ncontent<|im_end|>`
    (tool answers in a row as one user turn of <tool_response>s, as Qwen3's template writes them),
    the tools block in the system message, then the generation prompt (with the empty thinking
    block when thinking is off) and, when continuing, the answer's start."""
    last_query = _last_query(messages)
    turns = [(m.get("role", ""), _assistant(m, keep_thinking=at > last_query)
              if m.get("role") == "assistant" else _content(m)) for at, m in enumerate(messages)]
    if isinstance(tools, list) and tools:
        if turns and turns[0][0] == "system":
            turns[0] = ("system", turns[0][1] + "\n\n" + _tools_block(tools))
        else:
            turns.insert(0, ("system", _tools_block(tools)))
    ids: list[int] = []
    for at, (role, content) in enumerate(turns):
        if role != "tool":
            ids += [IM_START, *encode(f"{role}\n{content}"), IM_END, VOCAB["\n"]]
            continue
        # Qwen3's: tool answers in a row share one user turn, each in a <tool_response>.
        first, last = at == 0 or turns[at - 1][0] != "tool", \
            at + 1 == len(turns) or turns[at + 1][0] != "tool"
        ids += ([IM_START] if first else []) + encode(
            ("user" if first else "") + f"\n<tool_response>\n{content}\n</tool_response>")
        ids += [IM_END, VOCAB["\n"]] if last else []
    ids += GENERATION
    if not thinking:
        ids += NO_THINK
    if prefix:
        ids += encode(prefix)
    return ids


def split_prompt(ids: list[int]) -> tuple[list[int], list[int], bool]:
    """(prompt ids, the answer's ids so far, thinking) of a context: the answer is what follows
    the last generation prompt (and the empty thinking block, which means thinking is off). A
    context without a generation prompt is all prompt, as a raw `/generate` text is."""
    n = len(GENERATION)
    starts = [at for at, token in enumerate(ids) if token == IM_START]
    for at in reversed(starts):
        if tuple(ids[at:at + n]) == GENERATION:
            end = at + n
            thinking = tuple(ids[end:end + len(NO_THINK)]) != NO_THINK
            end += 0 if thinking else len(NO_THINK)
            return ids[:end], ids[end:], thinking
    return ids, [], True
