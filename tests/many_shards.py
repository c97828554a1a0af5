"""A run's output written straight to disk, fast: many shards in genq's naming and line format,
indices interleaved across all of them as concurrent consumers leave them, and the run manifest
beside them, so that `genq recover` can put the run into Redis and `genq export` read it back.

    python tests/many_shards.py DIR --run NAME --prompts 200000 --shards 2000

Index i's line is in shard ``i % shards``; every ``retry_every``-th index also has an older
attempt (a zombie's line) in the next shard, which export and recover must not pick.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import orjson

from genq.common.data import manifest as manifests

CONSUMERS = 4  # shards are spread over this many consumer names


def manifest(run: str, total: int) -> dict:
    return {"format": 1, "run": run, "dataset": "/data/many.jsonl", "fingerprint": "f" * 64,
            "total": total, "epoch": "e0many", "created_at": 1.0,
            "params": {"1": {"max_tokens": 64}}, "params_version": 1, "params_floor": 0,
            "history": [{"version": 1, "redo": "none", "inflight": "finish", "at": 0}]}


def record(run: str, index: int, attempt: int, content_bytes: int) -> dict:
    return {"index": index, "id": f"p{index}", "run": run, "params_version": 1,
            "attempt": attempt, "finish_reason": "stop", "prompt_tokens": 7,
            "completion_tokens": 11, "reasoning_content": None,
            "content": f"answer {index} attempt {attempt} " + "x" * content_bytes,
            "server": "http://sglang:30000", "model": "tiny", "latency_s": 0.5,
            "created_at": 100.0 + index / 1000}


def shard_path(out: Path, run: str, shard: int) -> Path:
    name = f"gpu{shard % CONSUMERS}"
    return out / f"{run}.{name}.20250101T000000000000000Z-{1000 + shard % CONSUMERS}." \
                 f"{shard // CONSUMERS + 1:06d}.jsonl"


def write_run(out: str | os.PathLike[str], run: str, prompts: int, shards: int, *,
              retry_every: int = 97, content_bytes: int = 64) -> list[Path]:
    """Write the shards and the manifest; returns the shard paths. Opens one file at a time."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [shard_path(out, run, s) for s in range(shards)]
    for s, path in enumerate(paths):
        lines = []
        for index in range(s, prompts, shards):
            lines.append(orjson.dumps(record(run, index, 2, content_bytes)) + b"\n")
        # Zombies: the first attempt of every retry_every-th index of the previous shard.
        for index in range((s - 1) % shards, prompts, shards):
            if retry_every and index % retry_every == 0:
                lines.append(orjson.dumps(record(run, index, 1, content_bytes)) + b"\n")
        path.write_bytes(b"".join(lines))
    manifests.write(out, manifest(run, prompts))
    return paths


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--run", required=True)
    p.add_argument("--prompts", type=int, default=200_000)
    p.add_argument("--shards", type=int, default=2_000)
    p.add_argument("--content-bytes", type=int, default=64)
    a = p.parse_args()
    paths = write_run(a.out, a.run, a.prompts, a.shards, content_bytes=a.content_bytes)
    size = sum(p.stat().st_size for p in paths)
    print(f"{len(paths)} shards, {a.prompts} prompts, {size:,} B in {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
