"""`genq recover`'s rebuild keeps its decisions in arrays (bounded memory at any run size,
issue 21) and decides exactly what the dict-based rebuild before it decided: checked against
that rebuild, kept here verbatim as the reference, over random shard lines and requeue
histories; restore writes the same bitfields, counters and bitmaps from either."""

from __future__ import annotations

from collections import Counter
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from genq.common.data import recovery
from genq.common.data.recovery import FIELDS, WIDTHS, Rules, _light
from genq.common.queue import bitmap
from genq.common.queue.keys import FINISH_NAMES

TOTAL = 30


def reference_rebuild(manifest: dict[str, Any], streams) -> dict[str, Any]:
    rules, total = Rules(manifest), int(manifest["total"])
    standing: dict[int, tuple] = {}
    kept: dict[int, tuple] = {}
    claims: dict[int, int] = {}
    gens: dict[int, int] = {}
    lines = skipped = refused = 0
    for stream in streams:
        for line in stream:
            lines += 1
            parsed = _light(line)
            if parsed is None or not 0 <= parsed[0] < total:
                skipped += bool(line.strip())
                continue
            index, result, created_at, gen, _ = parsed
            claims[index] = max(claims.get(index, 0), result[1])
            if rules.refused(result[0], created_at):
                refused += 1
                continue
            best = standing.get(index)
            if best is None or (result[0], gen, result[1]) > (best[0], gens[index], best[1]):
                standing[index], gens[index] = result, gen
    for index in [i for i, r in standing.items() if rules.covered(r[0], r[2])]:
        kept[index] = standing.pop(index)
    return {"standing": standing, "kept": kept, "claims": claims, "lines": lines,
            "skipped": skipped, "refused": refused}


def reference_bitfields(results: dict[int, tuple], claims: dict[int, int], size: int) -> dict:
    out = {name: bytearray(size * width) for name, width in WIDTHS.items()}

    def put(name: str, index: int, value: int) -> None:
        width = WIDTHS[name]
        value = min(value, (1 << (8 * width)) - 1)
        out[name][index * width:(index + 1) * width] = value.to_bytes(width, "big")

    for index, result in results.items():
        for name, value in zip(FIELDS, result, strict=True):
            put(name, index, value)
    for index, attempt in claims.items():
        put("claims", index, attempt)
    return out


def reference_counters(standing: dict[int, tuple]) -> tuple[dict[str, int], Counter]:
    names = Counter(FINISH_NAMES.get(r[2], "other") for r in standing.values())
    counters = {f"finish:{name}": n for name, n in names.items()}
    counters["ctok_sum"] = sum(r[3] for r in standing.values())
    counters["ptok_sum"] = sum(r[4] for r in standing.values())
    counters["cached_sum"] = sum(r[5] for r in standing.values())
    return counters, Counter(r[3] for r in standing.values())


class Recorder:
    """A MULTI pipeline that only remembers what was queued on it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


line_st = st.one_of(
    st.fixed_dictionaries({
        "index": st.integers(-1, TOTAL + 1), "params_version": st.integers(1, 3),
        "attempt": st.integers(0, 5),
        "finish_reason": st.sampled_from(["stop", "length", "abort", None, "weird"]),
        "completion_tokens": st.integers(0, 70_000), "prompt_tokens": st.integers(0, 9),
        "cached_tokens": st.integers(0, 9),
        "created_at": st.sampled_from([10.0, 50.0, 60.0, 90.0]),
    }).map(lambda d: orjson.dumps(d) + b"\n"),
    st.sampled_from([b"torn", b"garbage\n", b"\n", b'{"index": 1}\n', b"[1]\n"]),
)
history_st = st.lists(
    st.fixed_dictionaries({"redo": st.sampled_from(["none", "truncated", "all"]),
                           "inflight": st.sampled_from(["finish", "abort"]),
                           "at": st.sampled_from([40.0, 55.0, 80.0])}),
    max_size=3,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(line_st, max_size=25), max_size=4), history_st)
def test_rebuild_decides_what_the_rebuild_before_it_decided(streams, changes):
    history = [{"version": 1, "redo": "none", "inflight": "finish", "at": 0},
               *({**h, "version": v} for v, h in enumerate(changes, start=2))]
    manifest = {"format": 1, "run": "x", "dataset": "/d", "fingerprint": "f", "total": TOTAL,
                "epoch": "e", "created_at": 1.0, "params": {"1": {}},
                "params_version": len(history), "params_floor": 0, "history": history}
    want = reference_rebuild(manifest, streams)
    got = recovery.rebuild(manifest, streams)
    assert dict(got.standing) == want["standing"] and dict(got.kept) == want["kept"]
    assert got.claims == want["claims"] and dict(got.claims) == want["claims"]
    assert (got.lines, got.skipped, got.refused) == (want["lines"], want["skipped"],
                                                     want["refused"])
    assert len(got.standing) == len(want["standing"]) and len(got.kept) == len(want["kept"])
    both = {**want["kept"], **want["standing"]}
    # At the run's final size, as a new run's (PER_INDEX_BITS), not the highest index's.
    assert recovery._bitfields(got) == reference_bitfields(both, want["claims"], TOTAL)
    counters, hist = recovery._counters(got)
    assert (counters, hist) == reference_counters(want["standing"])
    pipe = Recorder()
    recovery.restore(pipe, recovery.RunKeys("x"), manifest, got, ["/out"])
    sets: dict = {}
    for name, args, _ in pipe.calls:  # the first SET of each key (later ones are NX)
        if name == "set":
            sets.setdefault(args[0], args[1])
    keys = recovery.RunKeys("x")
    assert sets[keys.done] == bitmap.encode(want["standing"], TOTAL)
    assert sets[keys.truncated] == bitmap.encode(
        [i for i, r in want["standing"].items() if r[2] == recovery.LENGTH], TOTAL)
    assert sets.get(keys.kept) == (bitmap.encode(want["kept"], TOTAL) if want["kept"] else None)


def test_results_read_as_mappings():
    rec = recovery.rebuild(
        {"total": 5, "history": [{"version": 1, "redo": "none", "inflight": "finish"}]},
        [[orjson.dumps({"index": 3, "params_version": 1, "attempt": 2}) + b"\n"]])
    assert list(rec.standing) == [3] and rec.standing[3] == (1, 2, 4, 0, 0, 0)
    assert 3 in rec.standing and 2 not in rec.standing and "3" not in rec.standing
    assert rec.standing.get(7) is None and not rec.kept and rec.claims == {3: 2}
