"""Which way to read a streamed answer costs the least CPU per chunk: the choice behind
common/sglang/client.py. bench/_bare_stream.py runs once per path, each in its own process,
against one simulator sending a chunk per token, with the same requests and concurrency:
aiohttp (aiohttp straight, its own line reader); httpx-lines (httpx's API on aiohttp's pool,
httpx-aiohttp, `aiter_lines()`); httpx-raw (the same client, `aiter_raw()` split into byte
lines: what genq does).

    python bench/stream_path.py                 # 80 answers of 2,000 tokens, 40 at once
"""

from __future__ import annotations

import json
import subprocess
import sys

import _common as kit


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--n", type=int, default=80)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=40)
    p.add_argument("--time-scale", type=float, default=2.0)
    a = p.parse_args()
    load, paths = kit.load_average(), []
    flags = ["--length-dist", f"fixed:{a.tokens}", "--stream-interval", "1", "--ttft", "0",
             "--reasoning-parser", "qwen3", "--time-scale", str(a.time_scale),
             "--max-running-requests", str(a.concurrency)]
    with kit.workdir() as work, kit.simulators(1, *flags) as [sim]:
        dataset = kit.write_dataset(work / "prompts.jsonl", a.n)
        for path in ("aiohttp", "httpx-lines", "httpx-raw"):
            out = subprocess.run(
                [sys.executable, str(kit.REPO / "bench" / "_bare_stream.py"), "--server",
                 sim.url, "--dataset", str(dataset), "--n", str(a.n), "--concurrency",
                 str(a.concurrency), "--path", path], capture_output=True, text=True,
                check=True).stdout
            paths.append({"path": path, **json.loads(out)})
    print(f"\n{a.n} answers of {a.tokens} tokens, a chunk per token, {a.concurrency} at once, "
          f"time scale {a.time_scale}; load average before: {load}\n")
    print(kit.table([(x["path"], x["chunks"], f"{1e6 * x['cpu_s'] / x['chunks']:.2f}")
                     for x in paths], ("path", "chunks", "client CPU us per chunk")))
    kit.dump_json(a.json, {"paths": paths})
    return 0


if __name__ == "__main__":
    sys.exit(main())
