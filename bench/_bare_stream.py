"""The bare client of bench/throughput.py and restart.py: prompts in memory, a chat request per
slot over aiohttp, streamed (--whole: whole answers, genq's default), each answer parsed and
kept; genq's GC settings, no Redis, no disk. --retry: a 503 is sent again shortly. Prints one
JSON line of figures (the caller measures the process)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
from typing import Any

import aiohttp
import orjson


async def read_streamed(lines: Any) -> tuple[int, int]:
    """(completion tokens, chunks) of a streamed answer, its text joined as a client keeps it."""
    content, reasoning, usage, chunks = [], [], {}, 0
    async for line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = orjson.loads(data)
        chunks += 1
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            if text := choice["delta"].get("content"):
                content.append(text)
            if text := choice["delta"].get("reasoning_content"):
                reasoning.append(text)
    "".join(content), "".join(reasoning)  # the answer, as a client would keep it
    return int(usage.get("completion_tokens") or 0), chunks


async def read_whole(lines: Any) -> tuple[int, int]:
    """(completion tokens, 1) of a whole answer, its text kept as a client keeps it."""
    answer = orjson.loads(await lines.read())
    message = answer["choices"][0]["message"]
    message.get("content"), message.get("reasoning_content")  # the answer, as a client keeps it
    return int(answer["usage"]["completion_tokens"]), 1


async def main(a: argparse.Namespace) -> dict:
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    with open(a.dataset, "rb") as f:
        rows = [orjson.loads(line) for _, line in zip(range(a.n), f, strict=False)]
    url = a.server + "/v1/chat/completions"
    tokens = retries = chunks = 0
    todo = iter(range(len(rows)))

    async def one(session: aiohttp.ClientSession, index: int) -> int:
        nonlocal retries, chunks
        row = rows[index]
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        how = {} if a.whole else {"stream": True, "stream_options": {"include_usage": True}}
        body = orjson.dumps({"model": "default", "messages": messages,
                             "max_tokens": 4096, **how})
        while True:
            async with session.post(url, data=body, headers={"content-type": "application/json"}
                                    ) as resp:
                status, lines = resp.status, resp.content
                if status != 200:
                    if not a.retry:
                        raise RuntimeError(f"HTTP {status}")
                    retries += 1
                    await asyncio.sleep(0.1 + 0.2 * random.random())  # refused: again shortly
                    continue
                tokens, got = await (read_whole(lines) if a.whole else read_streamed(lines))
                chunks += got
                return tokens

    async def slot(session: aiohttp.ClientSession) -> None:
        nonlocal tokens
        for index in todo:
            got = await one(session, index)  # not `tokens += await ...`: a lost update
            tokens += got

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session, \
            asyncio.TaskGroup() as tg:
        for _ in range(min(a.concurrency, len(rows))):
            tg.create_task(slot(session))
    return {"n": len(rows), "tokens": tokens, "chunks": chunks, "retries": retries}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for name, kind in (("--server", str), ("--dataset", str), ("--n", int), ("--concurrency", int)):
        p.add_argument(name, type=kind, required=True)
    for flag in ("--retry", "--whole"):  # --whole: whole answers, not streamed
        p.add_argument(flag, action="store_true")
    print(json.dumps(asyncio.run(main(p.parse_args()))))
