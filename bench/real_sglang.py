"""A real SGLang 0.5.23 server (scripts/real-sglang.sh start; figures in docs/SGLANG.md).
stream-cost: the same requests with `stream: true` and without, alternating. samples: K seeded
requests a prompt against one with `n=K`, and whether a seeded request asked again (temperature
0.6) gives the same answer, alone and beside other traffic.

    PORT=31555 scripts/real-sglang.sh start && python bench/real_sglang.py stream-cost --port 31555
    python bench/real_sglang.py samples --port 31555 [--k 4] [--prompts 4]
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

NONCE = time.time_ns()  # this run's prompts are in no earlier run's prefix cache
COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "cached_tokens_total")


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {name: sum(float(x) for x in re.findall(
        rf'^sglang:{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$', text, re.M)) for name in COUNTERS}


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


def stream_cost(a, url: str) -> dict:
    load, got = load_average(), {True: [], False: []}
    for _ in range(a.rounds):
        for stream in (False, True):
            g0, c0, t0 = metrics(url), server_cpu_s(a.port), time.monotonic()
            asyncio.run(batch(url, a.n, a.concurrency, a.max_tokens or 256, stream))
            wall = time.monotonic() - t0
            tokens = metrics(url)["generation_tokens_total"] - g0["generation_tokens_total"]
            got[stream].append({"tokens": tokens, "wall_s": wall,
                                "cpu_s": server_cpu_s(a.port) - c0})
    rows = [(("stream: true" if s else "no stream"), f"{sum(x['tokens'] for x in r):.0f}",
             f"{sum(x['tokens'] for x in r) / sum(x['wall_s'] for x in r):.1f}",
             f"{1000 * sum(x['cpu_s'] for x in r) / sum(x['tokens'] for x in r):.2f}")
            for s, r in got.items()]
    print(f"\n{a.rounds} x {a.n} requests each way, {a.concurrency} at once; load average "
          f"before: {load}\n")
    print(table(rows, ("requests", "tokens generated", "server tokens/s",
                       "server CPU ms per token")))
    return {"stream": got[True], "plain": got[False]}


def body(prompt: int, max_tokens: int, **extra: object) -> dict:
    # A long prompt, so a prefix shared or not shows in the prompt-token counters.
    text = f"Prompt {prompt} of {NONCE}. " + "Tell me a long story about the sea and ships. " * 40
    return {"model": "default", "max_tokens": max_tokens, "temperature": 0.6,
            "messages": [{"role": "user", "content": text}], **extra}


async def ask(client: httpx.AsyncClient, url: str, b: dict) -> list[str]:
    reply = (await client.post(url + "/v1/chat/completions", json=b)).json()
    return [(c["message"].get("reasoning_content") or "") + (c["message"]["content"] or "")
            for c in reply["choices"]]


async def arm(url: str, a, n_mode: bool) -> dict:
    # Prompts of their own per arm: neither finds the other's in the prefix cache.
    prompts, before, t0 = range(1000 * n_mode, 1000 * n_mode + a.prompts), metrics(url), \
        time.monotonic()
    async with httpx.AsyncClient(timeout=None) as client:
        calls = ([ask(client, url, body(p, a.max_tokens, n=a.k)) for p in prompts] if n_mode else
                 [ask(client, url, body(p, a.max_tokens, seed=1000 * p + s))
                  for p in prompts for s in range(a.k)])
        answers = [text for got in await asyncio.gather(*calls) for text in got]
    wall, after = time.monotonic() - t0, metrics(url)
    delta = {name: after[name] - before[name] for name in COUNTERS}
    return {"arm": f"n={a.k}" if n_mode else f"{a.k} seeded requests", **delta,
            "tok_per_s": round(delta["generation_tokens_total"] / wall, 1),
            "distinct_per_prompt": round(len(set(answers)) / a.prompts, 2)}


async def reproduce(url: str, max_tokens: int, tries: int) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        async def one(b: dict) -> str:
            return (await ask(client, url, b))[0]

        alone = [await one(body(7, max_tokens, seed=42)) for _ in range(tries)]
        other = await one(body(7, max_tokens, seed=43))
        busy = [(await asyncio.gather(one(body(7, max_tokens, seed=42)),
                                      *(one(body(100 + i, max_tokens)) for i in range(6))))[0]
                for _ in range(tries)]
    return {"same_alone": len(set(alone)) == 1, "same_beside_traffic": len(set(busy)) == 1,
            "alone_equals_busy": alone[0] == busy[0], "another_seed_differs": other != alone[0]}


def samples(a, url: str) -> dict:
    a.max_tokens = a.max_tokens or 64
    rows = [asyncio.run(arm(url, a, n_mode)) for n_mode in (False, True)]
    print(table([tuple(r.values()) for r in rows], tuple(rows[0])))
    same = asyncio.run(reproduce(url, a.max_tokens, a.tries))
    print("reproducible:", same)
    return {"arms": rows, "reproducible": same}


def main() -> int:
    p = parser(__doc__)
    p.add_argument("what", choices=("stream-cost", "samples"))
    p.add_argument("--port", type=int, default=31555)
    p.add_argument("--max-tokens", type=int, help="default: 256 (stream-cost), 64 (samples)")
    p.add_argument("--n", type=int, default=64, help="stream-cost: requests each way a round")
    p.add_argument("--concurrency", type=int, default=16, help="stream-cost")
    p.add_argument("--rounds", type=int, default=2, help="stream-cost")
    p.add_argument("--prompts", type=int, default=4, help="samples")
    p.add_argument("--k", type=int, default=4, help="samples: a prompt's samples")
    p.add_argument("--tries", type=int, default=3, help="samples: asks of one seeded request")
    a = p.parse_args()
    url = f"http://127.0.0.1:{a.port}"
    dump_json(a.json, (stream_cost if a.what == "stream-cost" else samples)(a, url))
    return 0


if __name__ == "__main__":
    sys.exit(main())
