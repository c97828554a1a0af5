"""Which way to read a streamed answer costs the least CPU per chunk: the choice behind
common/sglang/client.py. bench/_bare_stream.py runs once per path, each in its own process,
against one simulator sending a chunk per token, with the same requests and concurrency:

- aiohttp: aiohttp straight, its own line reader;
- httpx-lines: httpx's API on aiohttp's pool (httpx-aiohttp), `aiter_lines()`;
- httpx-raw: the same client, `aiter_raw()` split into byte lines (what genq does).

    python bench/stream_path.py                 # 80 answers of 2,000 tokens, 40 at once
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, dump_json, load_average, simulators, table, write_dataset

PATHS = ("aiohttp", "httpx-lines", "httpx-raw")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=80)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=40)
    p.add_argument("--time-scale", type=float, default=2.0)
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args()
    load = load_average()
    dataset = write_dataset(Path(tempfile.mkdtemp()) / "prompts.jsonl", a.n)
    flags = ["--length-dist", f"fixed:{a.tokens}", "--stream-interval", "1", "--ttft", "0",
             "--reasoning-parser", "qwen3", "--time-scale", str(a.time_scale),
             "--max-running-requests", str(a.concurrency)]
    paths, rows = [], []
    with simulators(1, *flags) as [sim]:
        for path in PATHS:
            out = subprocess.run(
                [sys.executable, str(REPO / "bench" / "_bare_stream.py"), "--server", sim.url,
                 "--dataset", str(dataset), "--n", str(a.n), "--concurrency",
                 str(a.concurrency), "--path", path],
                capture_output=True, text=True, check=True).stdout
            got = {"path": path, **json.loads(out)}
            paths.append(got)
            rows.append((path, got["chunks"], f"{1e6 * got['cpu_s'] / got['chunks']:.2f}"))
    print(f"\n{a.n} answers of {a.tokens} tokens, a chunk per token, {a.concurrency} at once, "
          f"time scale {a.time_scale}; load average before: {load}\n")
    print(table(rows, ("path", "chunks", "client CPU us per chunk")))
    dump_json(a.json, {"paths": paths})
    return 0


if __name__ == "__main__":
    sys.exit(main())
