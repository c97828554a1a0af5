"""Another client on the same server, for tests/test_capacity_tracking.py: keeps --inflight chat
requests in flight for --seconds (or until SIGTERM), then lets those in flight finish and
prints one JSON line: requests answered and their mean latency (what a neighbour feels of a
waiting queue on the server)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time

import httpx


async def main(a: argparse.Namespace) -> dict:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    deadline = time.monotonic() + a.seconds
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=a.inflight)
    async with httpx.AsyncClient(base_url=a.server, timeout=600, limits=limits) as client:

        async def one(n: int) -> None:
            i = 0
            while not stop.is_set() and time.monotonic() < deadline:
                body = {"messages": [{"role": "user", "content": f"Neighbour {n} asks {i}."}],
                        "max_tokens": 4096}
                t0 = time.monotonic()
                response = await client.post("/v1/chat/completions", json=body)
                response.raise_for_status()
                latencies.append(time.monotonic() - t0)
                i += 1

        async with asyncio.TaskGroup() as tg:
            for n in range(a.inflight):
                tg.create_task(one(n))
    mean = sum(latencies) / len(latencies) if latencies else 0.0
    return {"requests": len(latencies), "mean_latency_s": mean}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True)
    p.add_argument("--inflight", type=int, default=16, help="requests kept in flight (16)")
    p.add_argument("--seconds", type=float, default=3600.0, help="how long to keep them")
    print(json.dumps(asyncio.run(main(p.parse_args()))), flush=True)
