"""Bare-client costs of the consumer's building blocks, side by side in one run: the HTTP client
(httpx with its default transport, httpx with the httpx-aiohttp transport, plain aiohttp), the
event loop (asyncio, uvloop) and the Redis reply parser (hiredis, pure Python). Each variant runs
in its own process, rounds alternate between variants, medians are reported.

    python bench/http_transport.py                     # 3000 requests x 2 rounds per variant
    python bench/http_transport.py --n 3000 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from _common import REPO, RedisServer, Simulator, dump_json, env, table

SIM_FLAGS = ["--time-scale", "10000", "--ttft", "0", "--length-dist", "fixed:16",
             "--max-running-requests", "64"]
HTTP_CLIENTS = ("httpx", "httpx-aiohttp", "aiohttp")
LOOPS = ("asyncio", "uvloop")
PARSERS = ("hiredis", "python")
# A reply shaped like claim.lua's: the version, then one row per lease.
CLAIM_LIKE = ("redis.call('hincrby', KEYS[1], 'claims', 1) "
              "return {7, {'0f3a9c1e2b4d5a6f7e8d9c0b', 123456, 'a1b2c3d4e5f6', 1, 1}}")


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# --- children: one variant each, print one JSON line -----------------------------------------
async def run_slots(n: int, concurrency: int, one) -> dict:
    todo = iter(range(n))
    await one(-1)  # warm: connection set-up and first-call costs stay out of the figures

    async def slot() -> None:
        for i in todo:
            await one(i)

    t0, c0 = time.monotonic(), cpu_s()
    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(slot())
    return {"wall_s": time.monotonic() - t0, "cpu_s": cpu_s() - c0}


def chat_body(i: int) -> bytes:
    import orjson

    from common.params import DEFAULTS, request_body
    messages = [{"role": "user", "content": f"Write program number {i}."}]
    return orjson.dumps(request_body(messages, dict(DEFAULTS), "sim"))


async def http_child(a: argparse.Namespace) -> dict:
    import orjson
    bodies = [chat_body(i) for i in range(a.n)]
    headers = {"content-type": "application/json"}
    url = a.server + "/v1/chat/completions"
    if a.client == "aiohttp":
        import aiohttp
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=a.concurrency + 8))

        async def one(i: int) -> None:
            async with session.post(url, data=bodies[i], headers=headers) as resp:
                data = orjson.loads(await resp.read())
            assert data["choices"][0]["finish_reason"]
        close = session.close
    else:
        import httpx
        limits = httpx.Limits(max_connections=a.concurrency + 8,
                              max_keepalive_connections=a.concurrency + 8)
        transport = None
        if a.client == "httpx-aiohttp":
            from httpx_aiohttp import AiohttpTransport
            transport = AiohttpTransport(limits=limits)
        client = httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits,
                                   transport=transport)

        async def one(i: int) -> None:
            resp = await client.post(url, content=bodies[i], headers=headers)
            assert orjson.loads(resp.content)["choices"][0]["finish_reason"]
        close = client.aclose
    try:
        return await run_slots(a.n, a.concurrency, one)
    finally:
        await close()


async def redis_child(a: argparse.Namespace) -> dict:
    import redis.asyncio as aioredis
    from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser
    parser = _AsyncHiredisParser if a.parser == "hiredis" else _AsyncRESP2Parser
    r = aioredis.Redis.from_url(a.redis, parser_class=parser,
                                max_connections=a.concurrency + 8)
    sha = await r.script_load(CLAIM_LIKE)

    async def one(i: int) -> None:
        # One claim-shaped EVALSHA and one ack-shaped integer reply per "task".
        version, row = await r.evalsha(sha, 1, "bench:h")
        await r.evalsha(sha, 1, "bench:h")
        assert version == 7 and int(row[1]) == 123456
    try:
        return await run_slots(a.n, a.concurrency, one)
    finally:
        await r.aclose()


def child(a: argparse.Namespace) -> None:
    main = http_child if a.server else redis_child
    if a.loop == "uvloop":
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            out = runner.run(main(a))
    else:
        out = asyncio.run(main(a))
    print(json.dumps(out))


# --- parent: alternate the variants, report medians ------------------------------------------
def variant_round(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"variant {args} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def run_all(a: argparse.Namespace) -> dict[str, list[dict]]:
    variants: dict[str, list[str]] = {}
    with Simulator(*SIM_FLAGS) as sim, RedisServer() as rs:
        for client in HTTP_CLIENTS:
            for loop in LOOPS:
                variants[f"http {client} / {loop}"] = [
                    "--server", sim.url, "--client", client, "--loop", loop]
        for parser in PARSERS:
            for loop in LOOPS:
                variants[f"redis {parser} / {loop}"] = [
                    "--redis", rs.url, "--parser", parser, "--loop", loop]
        results: dict[str, list[dict]] = {name: [] for name in variants}
        for i in range(a.rounds):
            for name, args in variants.items():
                n = a.redis_n if name.startswith("redis") else a.n
                got = variant_round([*args, "--n", str(n), "--concurrency", str(a.concurrency)])
                got["n"] = n
                results[name].append(got)
                print(f"round {i + 1} {name}: {n / got['wall_s']:.0f}/s, "
                      f"{1000 * got['cpu_s'] / n:.3f} ms CPU", file=sys.stderr)
    return results


def report(a: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    rows = []
    base = {}
    for name, rounds in results.items():
        n = rounds[0]["n"]
        rate = statistics.median(n / x["wall_s"] for x in rounds)
        ms = statistics.median(1000 * x["cpu_s"] / n for x in rounds)
        kind = name.split()[0]
        base.setdefault(kind, ms)  # the first variant of each kind is the baseline
        spread = ", ".join(f"{1000 * x['cpu_s'] / n:.3f}" for x in rounds)
        rows.append((name, f"{rate:.0f}", f"{ms:.3f}", spread, f"{ms / base[kind]:.2f}"))
    print(f"\nhttp: {a.n} chat requests per round to the simulator {' '.join(SIM_FLAGS)}; "
          f"redis: {a.redis_n} tasks x 2 EVALSHA per round; {a.concurrency} in flight; "
          f"median of {a.rounds} rounds; load average before: {a.load_before}\n")
    print(table(rows, ("variant", "per s", "CPU ms each", "CPU ms each, every round",
                       "CPU / first of its kind")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=3000, help="HTTP requests per round (default 3000)")
    p.add_argument("--redis-n", type=int, default=10000,
                   help="Redis tasks (2 EVALSHA each) per round (default 10000)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per variant (default 2)")
    p.add_argument("--concurrency", type=int, default=64, help="in flight (default 64)")
    p.add_argument("--json", help="also write every round's figures here")
    # Child mode: one variant in this process.
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--server", help=argparse.SUPPRESS)
    p.add_argument("--redis", help=argparse.SUPPRESS)
    p.add_argument("--client", choices=HTTP_CLIENTS, help=argparse.SUPPRESS)
    p.add_argument("--parser", choices=PARSERS, help=argparse.SUPPRESS)
    p.add_argument("--loop", choices=LOOPS, default="asyncio", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
        return 0
    a.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results = run_all(a)
    report(a, results)
    dump_json(a.json, {"n": a.n, "redis_n": a.redis_n, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
