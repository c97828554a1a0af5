"""Does streaming cost a real SGLang server throughput? The same requests at the same
concurrency with `stream: true` and without, alternating, against a real SGLang 0.5.23 server
(scripts/real-sglang.sh start): the server's own generated tokens per second (its
sglang:generation_tokens_total) and the CPU its processes used.

    PORT=31555 scripts/real-sglang.sh start && python bench/real_stream_cost.py --port 31555
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import httpx
from _common import dump_json, load_average, parser, table

GENERATED = re.compile(r'^sglang:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$', re.M)


def generated(url: str) -> float:
    return sum(float(x) for x in GENERATED.findall(httpx.get(url + "/metrics").text))


def server_cpu_s(port: int) -> float:
    """CPU seconds of the server's whole process group (scheduler and tokenizer included)."""
    pid = open(os.path.expanduser(f"~/.cache/genq-real-sglang/run/server-{port}.pid")).read()
    out = subprocess.run(["ps", "-o", "cputimes=", "-g", pid.strip()], capture_output=True,
                         text=True).stdout
    return float(sum(int(x) for x in out.split()))


async def batch(url: str, n: int, concurrency: int, max_tokens: int, stream: bool) -> None:
    todo = iter(range(n))
    async with httpx.AsyncClient(timeout=None) as client:
        async def slot() -> None:
            for i in todo:
                body = {"model": "default", "max_tokens": max_tokens, "stream": stream,
                        "messages": [{"role": "user", "content": f"Tell me story {i}."}]}
                async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_raw():
                        pass
        await asyncio.gather(*(slot() for _ in range(concurrency)))


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--port", type=int, default=31555)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    url, load, got = f"http://127.0.0.1:{a.port}", load_average(), {True: [], False: []}
    for _ in range(a.rounds):
        for stream in (False, True):
            g0, c0, t0 = generated(url), server_cpu_s(a.port), time.monotonic()
            asyncio.run(batch(url, a.n, a.concurrency, a.max_tokens, stream))
            wall, tokens = time.monotonic() - t0, generated(url) - g0
            got[stream].append({"tokens": tokens, "wall_s": wall,
                                "cpu_s": server_cpu_s(a.port) - c0})
    rows = [(("stream: true" if s else "no stream"), f"{sum(x['tokens'] for x in r):.0f}",
             f"{sum(x['tokens'] for x in r) / sum(x['wall_s'] for x in r):.1f}",
             f"{1000 * sum(x['cpu_s'] for x in r) / sum(x['tokens'] for x in r):.2f}")
            for s, r in got.items()]
    print(f"\n{a.rounds} x {a.n} requests each way, {a.concurrency} at once, max_tokens "
          f"{a.max_tokens}; load average before: {load}\n")
    print(table(rows, ("requests", "tokens generated", "server tokens/s",
                       "server CPU ms per token")))
    dump_json(a.json, {"stream": got[True], "plain": got[False]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
