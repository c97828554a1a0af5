"""conversations.py's `bare` arm: rows in memory, 64 slots over aiohttp, each assistant turn asked
in order with the model's answers in place of the row's, stopping where genq's does; no Redis, no
disk, genq's GC settings. Args: SERVER DATASET PART OF MAX_TOKENS (rows n % OF == PART)."""

from __future__ import annotations

import asyncio
import gc
import sys
from typing import Any

import aiohttp
import orjson


def names(calls: list[dict[str, Any]] | None) -> list[str]:
    return sorted(c["function"]["name"] for c in calls or ())


async def main(server: str, dataset: str, part: int, of: int, max_tokens: int) -> dict:
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    with open(dataset, "rb") as f:
        todo = iter([orjson.loads(line) for n, line in enumerate(f) if n % of == part])
    gens = stopped = 0
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    timeout=aiohttp.ClientTimeout(total=None))

    async def ask(messages: list[dict[str, Any]], tools: list[dict[str, Any]]
                  ) -> tuple[dict[str, Any], str]:
        body = orjson.dumps({"model": "default", "messages": messages, "tools": tools,
                             "max_tokens": max_tokens, "stream": False})
        async with session.post(server + "/v1/chat/completions", data=body,
                                headers={"content-type": "application/json"}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
            choice = orjson.loads(await resp.read())["choices"][0]
        made = {"role": "assistant", "content": choice["message"].get("content")}
        if calls := choice["message"].get("tool_calls"):
            made["tool_calls"] = calls
        return made, choice.get("finish_reason") or ""

    async def conversation(row: dict[str, Any]) -> None:
        nonlocal gens, stopped
        msgs, tools = row["messages"], row.get("tools") or []
        at = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        conv = msgs[:at[0]]
        for n, i in enumerate(at):
            made, finish = await ask(conv, tools)
            gens += 1
            if n + 1 == len(at):
                return
            calls, rest = made.get("tool_calls") or [], msgs[i + 1:at[n + 1]]
            results = [m for m in rest[:len(msgs[i].get("tool_calls") or ())]
                       if m["role"] == "tool"]
            if finish == "length" or names(calls) != names(msgs[i].get("tool_calls")) \
                    or len(results) < len(calls):
                stopped += 1
                return
            conv = [*conv, made, *({**r, "tool_call_id": c["id"]}
                                   for r, c in zip(results, calls, strict=False)),
                    *rest[len(results):]]

    async def slot() -> None:
        for row in todo:
            await conversation(row)

    async with asyncio.TaskGroup() as tg:
        for _ in range(64):
            tg.create_task(slot())
    await session.close()
    return {"generations": gens, "stopped": stopped}


if __name__ == "__main__":
    server, dataset, *numbers = sys.argv[1:]
    print(orjson.dumps(asyncio.run(main(server, dataset, *map(int, numbers)))).decode())
