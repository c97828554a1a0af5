"""Agentic-coding rows {"id", "messages", "tools"} at the seed's shape (conversations.py, chaos.py
--turns all): 1-3 user requests, each a chain of 1-20 calls to the row's first tool, then an
answer. A chain is as long as the simulator's `--tool-chains` makes it (`chain_length`), so a
regenerated turn calls where the row calls. Row i depends only on (seed, i)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import _common  # noqa: F401  (this tree's genq first on sys.path)
import orjson

from genq.simulator.toolcalls import chain_length

USERS = (1, 2, 3)
USER_WEIGHTS = (0.35, 0.35, 0.30)  # 1.95 user requests a row
# Words a message: lognormal (median, sigma, cap).
SYSTEM_WORDS = (90, 0.3, 200)
USER_WORDS = (25, 0.6, 200)
RESULT_WORDS = (40, 0.8, 400)
ANSWER_WORDS = (35, 0.6, 300)
SYSTEMS = 4  # distinct system prompts
TOOLS: dict[str, tuple[str, str]] = {  # name: (description, its one argument)
    "run_shell": ("Run a shell command in the repository and return its output.", "cmd"),
    "read_file": ("Read a file of the repository.", "path"),
    "write_file": ("Write a file of the repository, replacing its content.", "path"),
    "search_code": ("Search the repository for a regular expression.", "pattern"),
    "apply_patch": ("Apply a unified diff to the repository.", "diff"),
    "list_dir": ("List a directory of the repository.", "path"),
}


@cache
def _corpus() -> tuple[str, ...]:
    return tuple(" ".join(topics.values()).split())


def _words(rng: random.Random, shape: tuple[float, float, int]) -> str:
    median, sigma, cap = shape
    n = max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))
    return " ".join(rng.choices(_corpus(), k=n))


def tool(name: str) -> dict[str, Any]:
    description, arg = TOOLS[name]
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {arg: {"type": "string"}},
                       "required": [arg]}}}


def _call(rng: random.Random, name: str, n: int) -> dict[str, Any]:
    arg = TOOLS[name][1]
    value = " ".join(rng.choices(_corpus(), k=rng.randint(2, 8)))
    return {"id": f"call_{n}", "type": "function",
            "function": {"name": name, "arguments": orjson.dumps({arg: value}).decode()}}


def system_prompt(seed: int, which: int) -> str:
    rng = random.Random(f"system:{seed}:{which}")
    return "You are a coding agent working in the user's repository. " + _words(rng,
                                                                               SYSTEM_WORDS)


def row(seed: int, index: int) -> dict[str, Any]:
    rng = random.Random(f"{seed}:{index}")
    names = rng.sample(sorted(TOOLS), k=rng.randint(2, len(TOOLS)))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt(seed, rng.randrange(SYSTEMS))}]
    calls = 0
    for _ in range(rng.choices(USERS, USER_WEIGHTS)[0]):
        request = _words(rng, USER_WORDS)
        messages.append({"role": "user", "content": request})
        for _ in range(chain_length(request, seed)):  # 1-20 calls, most short, a long tail
            calls += 1
            call = _call(rng, names[0], calls)
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": _words(rng, RESULT_WORDS)})
        messages.append({"role": "assistant", "content": _words(rng, ANSWER_WORDS)})
    return {"id": f"conv-{seed}-{index}", "messages": messages,
            "tools": [tool(name) for name in names]}


def rows(n: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    return (row(seed, i) for i in range(n))


def write(path: Path, n: int, seed: int = 0) -> Path:
    with open(path, "wb") as f:
        for r in rows(n, seed):
            f.write(orjson.dumps(r) + b"\n")
    return path


def shape(sample: list[dict[str, Any]]) -> dict[str, float]:
    """Per row of a sample: user requests, assistant turns, tool calls, words; the longest chain."""
    users = turns = calls = words = longest = 0
    for r in sample:
        chain = 0
        for m in r["messages"]:
            role = m["role"]
            users += role == "user"
            turns += role == "assistant"
            calls += bool(m.get("tool_calls"))
            words += len((m.get("content") or "").split())
            chain = chain + 1 if m.get("tool_calls") else 0 if role == "user" else chain
            longest = max(longest, chain)
    n = max(1, len(sample))
    return {"rows": len(sample), "users_per_row": round(users / n, 2),
            "assistant_turns_per_row": round(turns / n, 2),
            "tool_calls_per_row": round(calls / n, 2), "longest_chain": longest,
            "words_per_row": round(words / n, 1)}
