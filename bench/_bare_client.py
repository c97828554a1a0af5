"""The ideal bare client for bench/consumer_throughput.py: genq's own SGLang client (the same
httpx.AsyncClient, timeouts and limits), the same request bodies and concurrency, to the same
server, with no Redis and no disk writes. Prints one JSON line with its figures."""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson  # noqa: E402
import structlog  # noqa: E402

from common.params import DEFAULTS, request_body  # noqa: E402
from common.sglang.client import SGLang  # noqa: E402


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def main(a: argparse.Namespace) -> dict:
    # Prompts are read before timing: an ideal client has its work in memory.
    with open(a.dataset, "rb") as f:
        rows = [orjson.loads(line)["messages"] for _, line in zip(range(a.n), f, strict=False)]
    # Same connection limits as `genq consume` without --concurrency (connections=1024).
    server = SGLang(a.server, request_timeout=3600.0, connections=1024)
    concurrency = a.concurrency or await server.capacity()
    model = await server.model()
    todo = iter(range(len(rows)))
    first: list[float] = []
    tokens = 0

    async def slot() -> None:
        nonlocal tokens
        for index in todo:
            body = request_body(rows[index], dict(DEFAULTS), model)
            completion = await server.chat(body, index)
            tokens += completion.completion_tokens
            if not first:
                first.extend((time.monotonic(), cpu_s()))

    t0, c0 = time.monotonic(), cpu_s()
    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(slot())
    t1, c1 = time.monotonic(), cpu_s()
    await server.close()
    return {"n": len(rows), "concurrency": concurrency, "tokens": tokens,
            "wall_s": t1 - t0, "cpu_s": c1 - c0,
            "steady_wall_s": t1 - first[0], "steady_cpu_s": c1 - first[1]}


if __name__ == "__main__":
    # The client's own log lines (server_load_source, ...) go to stderr: stdout is the one
    # JSON line the bench reads.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--concurrency", type=int, default=0)
    print(json.dumps(asyncio.run(main(p.parse_args()))))
