"""What `genq produce --token-ids` costs (docs/DEPLOY.md), ids off and on, on the same answers.
Ids are uniform over Qwen3's 151,669 (real ones favour small numbers: an upper bound).

    python bench/token_ids.py [--records 2000] [--prompt-median 3000]
"""

from __future__ import annotations

import random
import time
from pydoc_data.topics import topics

import orjson
import zstandard
from _common import dump_json, parser, table

from genq.common.data.records import build_record
from genq.common.sglang import continuation
from genq.common.sglang.stream import whole_answer
from genq.common.task import TaskId

VOCAB = 151_669
WORDS_PER_TOKEN = 0.75
SEED_RUN = 913_786  # prompts in the seed's data set
SHARD = 500  # records per shipped shard


def text(rng: random.Random, words: list[str], tokens: int) -> str:
    return " ".join(rng.choices(words, k=int(tokens * WORDS_PER_TOKEN)))


def answers(n: int, prompt_median: int, seed: int = 0) -> list[bytes]:
    """n server answers (whole, as SGLang sends them with return_token_ids)."""
    rng, corpus = random.Random(seed), " ".join(topics.values()).split()
    out = []
    for _ in range(n):
        ptoks = min(30_000, int(rng.lognormvariate(0, 0.6) * prompt_median))
        ctoks = min(4096, int(rng.lognormvariate(0, 0.45) * 2326))
        think = ctoks * 3 // 4
        out.append(orjson.dumps({"choices": [{
            "index": 0, "finish_reason": "length" if ctoks == 4096 else "stop",
            "message": {"role": "assistant", "reasoning_content": text(rng, corpus, think),
                        "content": text(rng, corpus, ctoks - think)},
            "prompt_token_ids": [rng.randrange(VOCAB) for _ in range(ptoks)],
            "response_token_ids": [rng.randrange(VOCAB) for _ in range(ctoks)]}],
            "usage": {"prompt_tokens": ptoks, "completion_tokens": ctoks}}))
    return out


def without_ids(body: bytes) -> bytes:
    data = orjson.loads(body)
    for key in ("prompt_token_ids", "response_token_ids"):
        del data["choices"][0][key]
    return orjson.dumps(data)


def lines(bodies: list[bytes]) -> tuple[list[bytes], float]:
    """The shard lines a consumer writes for these answers, and its CPU seconds per task."""
    t0, out = time.process_time(), []
    for i, body in enumerate(bodies):
        completion = whole_answer(body, "http://gpu0:30000", thinking=True)
        record = build_record(run="bench", task=TaskId(i), samples=1, prompt_id=f"p{i}",
                              version=1, attempt=1,
                              server="http://gpu0:30000", model="m", completion=completion,
                              latency_s=30.0)
        out.append(orjson.dumps(record) + b"\n")
    return out, (time.process_time() - t0) / len(bodies)


def shipped(records: list[bytes]) -> int:
    packer = zstandard.ZstdCompressor(level=3)
    return sum(len(packer.compress(b"".join(records[i:i + SHARD])))
               for i in range(0, len(records), SHARD))


def partial_bytes(records: list[bytes]) -> int:
    """Bytes of these records' partials in Redis, each packed as continuation.put packs it."""
    packer = zstandard.ZstdCompressor(level=3)
    return sum(len(packer.compress(orjson.dumps(
        {**{f: rec.get(f) for f in continuation.FIELDS}, "for_version": 2})))
        for rec in map(orjson.loads, records))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--records", type=int, default=2000)
    p.add_argument("--prompt-median", type=int, default=3000)
    a = p.parse_args()
    with_ids = answers(a.records, a.prompt_median)
    plain = [without_ids(b) for b in with_ids]
    rows, figures = [], {}
    for name, bodies in (("ids off", plain), ("ids on", with_ids)):
        lines(bodies[:50])  # warm up
        recs, cpu = lines(bodies)
        disk, s3, kept = sum(map(len, recs)), shipped(recs), partial_bytes(recs)
        figures[name] = {"records": len(recs), "jsonl_bytes": disk, "zstd_bytes": s3,
                         "partial_bytes": kept, "cpu_s_per_task": cpu}
        rows.append((name, f"{disk / len(recs) / 1024:.1f}", f"{s3 / len(recs) / 1024:.1f}",
                     f"{disk / len(recs) * SEED_RUN / 1e9:.1f}",
                     f"{s3 / len(recs) * SEED_RUN / 1e9:.1f}",
                     f"{kept / len(recs) / 1024:.1f}", f"{cpu * 1e3:.2f}"))
    print(table(rows, ("", "KiB/record JSONL", "KiB/record zstd", f"GB/{SEED_RUN} JSONL",
                       f"GB/{SEED_RUN} zstd", "KiB/partial in Redis", "CPU ms/task")))
    dump_json(a.json, figures)


if __name__ == "__main__":
    main()
