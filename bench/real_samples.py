"""K samples a prompt on a real SGLang 0.5.23 (scripts/real-sglang.sh start): K requests with a
seed each (genq's `--samples`) against one request with `n=K`; the server's prompt tokens and
cached (prefix-hit) tokens from /metrics, its generated tokens per second; and whether a seeded
request asked twice at temperature 0.6 gives the same answer.

    PORT=31777 scripts/real-sglang.sh start && python bench/real_samples.py --port 31777
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
from _common import dump_json, parser

NONCE = time.time_ns()  # this run's prompts are in no earlier run's prefix cache
COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "cached_tokens_total")


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {name: sum(float(x) for x in re.findall(
        rf'^sglang:{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$', text, re.M)) for name in COUNTERS}


def body(prompt: int, max_tokens: int, **extra: object) -> dict:
    # A long prompt, so a prefix shared or not shows in the prompt-token counters.
    text = f"Prompt {prompt} of {NONCE}. " + "Tell me a long story about the sea and ships. " * 40
    return {"model": "default", "max_tokens": max_tokens, "temperature": 0.6,
            "messages": [{"role": "user", "content": text}], **extra}


async def arm(url: str, prompts: range, k: int, max_tokens: int, n_mode: bool) -> list[str]:
    async with httpx.AsyncClient(timeout=None) as client:
        async def one(b: dict) -> list[str]:
            reply = (await client.post(url + "/v1/chat/completions", json=b)).json()
            return [(c["message"].get("reasoning_content") or "") + (c["message"]["content"] or "")
                    for c in reply["choices"]]

        if n_mode:
            calls = [one(body(p, max_tokens, n=k)) for p in prompts]
        else:
            calls = [one(body(p, max_tokens, seed=1000 * p + s))
                     for p in prompts for s in range(k)]
        return [text for answers in await asyncio.gather(*calls) for text in answers]


def measure(url: str, prompts: int, k: int, max_tokens: int, n_mode: bool) -> dict:
    before, t0 = metrics(url), time.monotonic()
    # Prompts of their own per arm: neither finds the other's in the prefix cache.
    answers = asyncio.run(arm(url, range(1000 * n_mode, 1000 * n_mode + prompts), k,
                              max_tokens, n_mode))
    wall, after = time.monotonic() - t0, metrics(url)
    delta = {name: after[name] - before[name] for name in COUNTERS}
    return {"arm": f"n={k}" if n_mode else f"{k} seeded requests", **delta,
            "tok_per_s": round(delta["generation_tokens_total"] / wall, 1),
            "distinct_per_prompt": round(len(set(answers)) / prompts, 2)}


async def reproduce(url: str, max_tokens: int, tries: int) -> dict:
    """The same seeded request `tries` times, alone and then beside other traffic."""
    async with httpx.AsyncClient(timeout=None) as client:
        async def ask(b: dict) -> str:
            message = (await client.post(url + "/v1/chat/completions", json=b)).json()[
                "choices"][0]["message"]
            return (message.get("reasoning_content") or "") + (message["content"] or "")

        alone = [await ask(body(7, max_tokens, seed=42)) for _ in range(tries)]
        other = await ask(body(7, max_tokens, seed=43))
        busy = []
        for _ in range(tries):
            got = await asyncio.gather(ask(body(7, max_tokens, seed=42)),
                                       *(ask(body(100 + i, max_tokens)) for i in range(6)))
            busy.append(got[0])
    return {"same_alone": len(set(alone)) == 1, "same_beside_traffic": len(set(busy)) == 1,
            "alone_equals_busy": alone[0] == busy[0], "another_seed_differs": other != alone[0]}


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--port", type=int, default=31777)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tries", type=int, default=3)
    a = p.parse_args()
    url = f"http://127.0.0.1:{a.port}"
    rows = [measure(url, a.prompts, a.k, a.max_tokens, n_mode) for n_mode in (False, True)]
    for row in rows:
        print(row)
    same = asyncio.run(reproduce(url, a.max_tokens, a.tries))
    print("reproducible:", same)
    dump_json(a.json, {"arms": rows, "reproducible": same})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
