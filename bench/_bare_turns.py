"""The bare conversation loop, bench/conversations.py's baseline beside `--turns all`: the rows
in memory, one slot a conversation over aiohttp, each assistant turn asked in order with the
model's answer in place of the row's and the row's tool results after its calls (their ids
the model's); a conversation stops where the model's calls are not the row's (by name) or an
answer reaches max_tokens, as genq's does. Whole answers (genq asks whole ones by default), no
Redis, no disk; genq's GC settings. Prints one JSON line of figures."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import resource
import time
from typing import Any

import aiohttp
import orjson


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def names(calls: list[dict[str, Any]] | None) -> list[str]:
    return sorted(c["function"]["name"] for c in calls or ())


async def main(a: argparse.Namespace) -> dict:
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    with open(a.dataset, "rb") as f:
        rows = [orjson.loads(line) for n, line in enumerate(f) if n % a.of == a.part]
    url = a.server + "/v1/chat/completions"
    todo, gens, stopped = iter(rows), 0, 0
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    timeout=aiohttp.ClientTimeout(total=None))

    async def ask(messages: list[dict[str, Any]], tools: list[dict[str, Any]], seed: int
                  ) -> tuple[dict[str, Any], str]:
        body = orjson.dumps({"model": "default", "messages": messages, "tools": tools,
                             "max_tokens": a.max_tokens, "seed": seed, "stream": False})
        async with session.post(url, data=body,
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
            made, finish = await ask(conv, tools, hash((row["id"], n)) & 0x7FFFFFFF)
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

    t0, c0 = time.monotonic(), cpu_s()
    async with asyncio.TaskGroup() as tg:
        for _ in range(min(a.concurrency, len(rows))):
            tg.create_task(slot())
    await session.close()
    return {"conversations": len(rows), "generations": gens, "stopped": stopped,
            "wall_s": time.monotonic() - t0, "cpu_s": cpu_s() - c0}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--part", type=int, default=0, help="this process's rows: n %% of == part")
    p.add_argument("--of", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=4096)
    print(json.dumps(asyncio.run(main(p.parse_args()))))
