"""The bare client of bench/throughput.py: the prompts in memory, one chat request per slot at a
time over aiohttp, streamed (--whole: the whole answer at once, as genq asks by default), each
answer parsed and kept (content and thinking joined, usage read), no Redis, no disk; genq's GC
settings (consumer/cli.py quiet_gc) and interpreter, so it differs from genq only by what genq
does. --retry: a refused request (503) is sent again after a short pause. Prints one JSON line
of figures."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import random
import resource
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Stream:
    """Sends a request and reads its answer's lines: (status, lines)."""

    def __init__(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None))

    @contextlib.asynccontextmanager
    async def post(self, url: str, body: bytes) -> AsyncIterator[tuple[int, Any]]:
        headers = {"content-type": "application/json"}
        async with self.session.post(url, data=body, headers=headers) as resp:
            yield resp.status, resp.content

    async def close(self) -> None:
        await self.session.close()


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

    async def one(stream: Stream, index: int) -> int:
        nonlocal retries, chunks
        row = rows[index]
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        how = {} if a.whole else {"stream": True, "stream_options": {"include_usage": True}}
        body = orjson.dumps({"model": "default", "messages": messages,
                             "max_tokens": a.max_tokens, **how})
        while True:
            async with stream.post(url, body) as (status, lines):
                if status != 200:
                    if not a.retry:
                        raise RuntimeError(f"HTTP {status}")
                    retries += 1
                    await asyncio.sleep(0.1 + 0.2 * random.random())  # refused: again shortly
                    continue
                tokens, got = await (read_whole(lines) if a.whole else read_streamed(lines))
                chunks += got
                return tokens

    async def slot(stream: Stream) -> None:
        nonlocal tokens
        for index in todo:
            got = await one(stream, index)  # not `tokens += await ...`: a lost update
            tokens += got

    t0, c0 = time.monotonic(), cpu_s()
    stream = Stream()
    async with asyncio.TaskGroup() as tg:
        for _ in range(min(a.concurrency, len(rows))):
            tg.create_task(slot(stream))
    await stream.close()
    return {"n": len(rows), "tokens": tokens, "chunks": chunks, "retries": retries,
            "wall_s": time.monotonic() - t0, "cpu_s": cpu_s() - c0}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--retry", action="store_true")
    p.add_argument("--whole", action="store_true", help="ask for whole answers, not streamed")
    print(json.dumps(asyncio.run(main(p.parse_args()))))
