"""Tool calls as Qwen2.5/Qwen3 write them and SGLang's qwen25 parser reads them: each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` in the answer's text (its ids
too), so a cut can land inside one; the parser takes the text before the first call as the
content and every complete call as a call (an unfinished one is dropped)."""

from __future__ import annotations

import json
import math
import random
import re
import uuid
from typing import Any

BOT, EOT = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(BOT) + "(.*?)" + re.escape(EOT), re.DOTALL)
# SGLang 0.5.23 takes both names for this parser and reports it as "qwen" in /get_server_info.
PARSERS = ("qwen", "qwen25")
# --tool-chains: tool calls an agent makes after a user request, lognormal (median, sigma), 1-20.
CHAIN_MEDIAN, CHAIN_SIGMA, CHAIN_MAX = 2.3, 0.8, 20


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """The text a model writes for one call (json.dumps' spacing, as Qwen's template shows)."""
    return f"{BOT}\n{json.dumps({'name': name, 'arguments': arguments})}\n{EOT}"


def _names(tools: Any) -> dict[str, int]:
    names: dict[str, int] = {}
    for at, tool in enumerate(tools if isinstance(tools, list) else ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.setdefault(function["name"], at)
    return names


def parse(text: str, tools: Any) -> tuple[str, list[dict[str, Any]]]:
    """SGLang 0.5.23's Qwen25Detector.detect_and_parse: (normal_text, calls as
    {tool_index, name, parameters}); a call of a tool the request lacks is skipped."""
    at = text.find(BOT)
    if at == -1:
        return text, []
    names, calls = _names(tools), []
    for block in _BLOCK.findall(text):
        try:
            action = json.loads(block.strip())
        except json.JSONDecodeError:
            continue
        for act in action if isinstance(action, list) else [action]:
            name = act.get("name") if isinstance(act, dict) else None
            if name in names:
                arguments = act.get("parameters") or act.get("arguments", {})
                calls.append({"tool_index": names[name], "name": name,
                              "parameters": json.dumps(arguments, ensure_ascii=False)})
    return text[:at].strip(), calls


def openai(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The parsed calls as a chat answer gives them: a fresh id each, `index` their order."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "index": n, "type": "function",
             "function": {"name": call["name"], "arguments": call["parameters"]}}
            for n, call in enumerate(calls)]


def chain_length(text: str, seed: int) -> int:
    """--tool-chains: the calls answered to the user request `text` before the final answer in
    text; a pure draw from the text and the simulator's --seed (a data set can mirror it)."""
    draw = random.Random(f"chain:{seed}:{text}").lognormvariate(math.log(CHAIN_MEDIAN),
                                                                CHAIN_SIGMA)
    return max(1, min(CHAIN_MAX, round(draw)))
