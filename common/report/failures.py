"""Why prompts failed: the top reasons with counts, from the failed bitmap and the errors hash
(index -> last error text), for `genq status`, /api/status, the monitor page and /metrics."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import redis

from common.queue import bitmap
from common.queue.keys import RunKeys
from common.queue.replies import blob, text

TOP = 5
CAP = 20_000  # reasons of the first CAP failed indices only (said so): a bounded read per poll
_ROW = re.compile(r"\brow \d+\b")
_POSITION = re.compile(r"line \d+ column \d+ \(char \d+\)|\(char \d+\)")


def reason_kind(text: str) -> str:
    """The reason without what differs per prompt (its row number, a JSON error's position),
    so one cause is one line with its count."""
    return _POSITION.sub("…", _ROW.sub("row N", text)).strip()[:300] or "(no reason recorded)"


def top_reasons(r: redis.Redis, k: RunKeys, failed: int) -> dict:
    """{"reasons": [{"reason", "count", "example_index"}...] (most common first), "counted":
    how many failed indices were looked at (all of them up to CAP)}."""
    if not failed:
        return {"reasons": [], "counted": 0}
    indices = list(itertools.islice(bitmap.set_indices(blob(r.get(k.failed))), CAP))
    texts = r.hmget(k.errors, [str(i) for i in indices]) if indices else []
    counts: Counter[str] = Counter()
    example: dict[str, int] = {}
    for index, raw in zip(indices, texts, strict=True):
        kind = reason_kind(text(raw or b"", errors="replace"))
        counts[kind] += 1
        example.setdefault(kind, index)
    reasons = [{"reason": kind, "count": n, "example_index": example[kind]}
               for kind, n in counts.most_common(TOP)]
    return {"reasons": reasons, "counted": len(indices)}
