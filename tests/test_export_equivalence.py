"""The two-pass export (bounded open files and memory, issue 21) writes byte for byte what the
export before it wrote, and reports the same: checked against that export, kept here verbatim
as the reference, over random shards (duplicates, zombies, torn and foreign lines, indices
out of range), accepted attempts present or lost, kept results and failed prompts."""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from export_reference import choose_records, failed_reasons
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipeline import record_failure

from genq.common.data.records import parse_line
from genq.common.data.shards import Picks, pick_lines
from genq.common.errors import GenqError
from genq.common.queue import bitmap
from genq.common.queue.keys import RunKeys
from genq.common.store import export


def reference(r, k, total, dirs, out, ambiguous, *, include_failed=False) -> export.ExportResult:
    """genq export as it was before issue 21 (every shard it touched kept open)."""
    accepted, is_done, _ = export.accepted_state(r, k)
    paths = export.shard_paths(dirs, k.run)
    torn = [0]

    def locate():
        for file_no, path in enumerate(paths):
            with open(path, "rb") as f:
                offset = 0
                for line in f:
                    start, offset = offset, offset + len(line)
                    record = parse_line(line)
                    if record is None or "index" not in record:
                        torn[0] += bool(line.strip())
                        continue
                    yield {"index": record["index"],
                           "params_version": record.get("params_version", 0),
                           "attempt": record.get("attempt", 0), "gen": record.get("gen", 0),
                           "digest": hash(line.rstrip(b"\n")),
                           "loc": (file_no, start, len(line))}

    chosen = choose_records(locate(), accepted, ambiguous)
    done_indices = [i for i in range(total) if is_done(i)]
    kept = export.kept_lookup(r, k)
    wanted = [i for i in done_indices if i in chosen]
    missing = [i for i in done_indices if i not in chosen]
    fallback = [i for i in wanted
                if (chosen[i]["params_version"], chosen[i]["attempt"]) != accepted(i)]
    failed = failed_reasons(r, k, total) if include_failed else {}
    handles: dict[int, Any] = {}
    with open(out, "wb") as dst:
        for index in sorted(set(wanted) | set(failed)):
            if index in failed:
                dst.write(export._failed_line(k.run, index, failed[index]))
                continue
            file_no, start, length = chosen[index]["loc"]
            if file_no not in handles:
                handles[file_no] = open(paths[file_no], "rb")
            src = handles[file_no]
            src.seek(start)
            line = src.read(length)
            dst.write(export.mark_kept(line) if kept(index) else line)
    for handle in handles.values():
        handle.close()
    return export.ExportResult(written=len(wanted), done=len(done_indices),
                               missing=missing[:20], torn_lines=torn[0], shards=len(paths),
                               not_accepted=fallback[:20], not_accepted_count=len(fallback),
                               failed_written=len(failed))


TOTAL = 40

line_st = st.one_of(
    st.tuples(st.integers(-2, TOTAL + 2), st.integers(1, 3), st.integers(1, 4),
              st.integers(0, 2)),
    st.sampled_from([b"torn", b"garbage", b"blank", b"noindex", b"list"]),
)
run_st = st.fixed_dictionaries({
    # dirs -> shards -> lines
    "dirs": st.lists(st.lists(st.lists(line_st, max_size=12), max_size=4), min_size=1,
                     max_size=2),
    "done": st.sets(st.integers(0, TOTAL - 1)),
    "failed": st.sets(st.integers(0, TOTAL - 1)),
    "kept": st.sets(st.integers(0, TOTAL - 1)),
    "accepted": st.dictionaries(st.integers(0, TOTAL - 1),
                                st.tuples(st.integers(0, 3), st.integers(0, 4))),
    "include_failed": st.booleans(),
})


def raw_line(spec, run: str, n: int) -> bytes:
    if spec == b"torn":
        return b'{"index": 1, "attempt": 2'
    if spec == b"garbage":
        return b"not json\n"
    if spec == b"blank":
        return b"\n"
    if spec == b"noindex":
        return b'{"run": "x"}\n'
    if spec == b"list":
        return b"[1, 2]\n"
    index, version, attempt, gen = spec
    record = {"index": index, "run": run, "params_version": version, "attempt": attempt,
              "content": f"line {n % 4} " + "é" * (n % 5)}  # some lines are copies
    if gen:
        record["gen"] = gen
    if n % 7 == 0:
        del record["params_version"]  # old shards: a missing field counts as 0
    return orjson.dumps(record) + b"\n"


def u16s(values: dict[int, int]) -> bytes:
    out = bytearray(2 * TOTAL)
    for index, value in values.items():
        out[2 * index:2 * index + 2] = value.to_bytes(2, "big")
    return bytes(out)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=run_st)
def test_export_writes_what_the_export_before_it_wrote(r, spec):
    k = RunKeys("eq" + uuid.uuid4().hex[:10])
    r.set(k.done, bitmap.encode(spec["done"], TOTAL))
    r.set(k.failed, bitmap.encode(spec["failed"], TOTAL))
    r.set(k.kept, bitmap.encode(spec["kept"], TOTAL))
    r.set(k.acc_version, u16s({i: v for i, (v, _) in spec["accepted"].items()}))
    r.set(k.acc_attempt, u16s({i: a for i, (_, a) in spec["accepted"].items()}))
    for i in spec["failed"]:
        record_failure(r, k, i, f"error of {i}: <é>")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            dirs, n = [], 0
            for d, shards in enumerate(spec["dirs"]):
                directory = Path(tmp, f"d{d}")
                directory.mkdir()
                dirs.append(str(directory))
                for s, lines in enumerate(shards):
                    data = b""
                    for line in lines:
                        data += raw_line(line, k.run, n)
                        n += 1
                    (directory / f"{k.run}.c{s % 2}.{s:06d}.jsonl").write_bytes(data)
            want_path, got_path = os.path.join(tmp, "want"), os.path.join(tmp, "got")
            flags = {"include_failed": spec["include_failed"]}
            ambiguous: set[int] = set()
            want = reference(r, k, TOTAL, dirs, want_path, ambiguous, **flags)
            if ambiguous:  # refused, naming them, unless allowed
                with pytest.raises(GenqError, match="two different lines"):
                    export.export(r, k, TOTAL, dirs, got_path, **flags)
            got = export.export(r, k, TOTAL, dirs, got_path, allow_ambiguous=True, **flags)
            assert got == want
            assert Path(got_path).read_bytes() == Path(want_path).read_bytes()
            assert not [name for name in os.listdir(tmp) if name.startswith("got.")]
    finally:
        r.delete(k.done, k.failed, k.kept, k.acc_version, k.acc_attempt, k.fail_kind,
                 k.fail_kinds)


records_st = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 3),
                                st.integers(0, 2), st.integers(0, 1)), max_size=40)


@given(records_st, st.dictionaries(st.integers(0, 5),
                                   st.tuples(st.integers(0, 3), st.integers(0, 3))))
def test_picks_apply_choose_records_rules(records, accepted):
    # (index, version, attempt, generation, text): lines alike but for their place are copies
    picks, ambiguous = Picks(6), set()
    for n, (index, version, attempt, gen, text) in enumerate(records):
        picks.offer(index, version, attempt, gen, hash((index, version, attempt, gen, text)),
                    accepted.get(index), 0, n, 1)
    chosen = choose_records([{"index": i, "params_version": v, "attempt": a, "gen": g, "n": n,
                              "digest": hash((i, v, a, g, t))}
                             for n, (i, v, a, g, t) in enumerate(records)], accepted.get,
                            ambiguous)
    assert {i for i in range(6) if picks.state[i]} == set(chosen)
    assert picks.ambiguous == ambiguous
    for index, record in chosen.items():
        assert picks.offset[index] == record["n"]
        assert bool(picks.state[index] == 2) == ((record["params_version"], record["attempt"])
                                                 == accepted.get(index))


def test_pick_lines_opens_one_shard_at_a_time(tmp_path, monkeypatch):
    paths = []
    for s in range(50):
        path = tmp_path / f"r.c.{s:06d}.jsonl"
        path.write_bytes(orjson.dumps({"index": s, "params_version": 1, "attempt": 1}) + b"\n")
        paths.append(path)
    before = len(os.listdir("/proc/self/fd"))
    seen = []

    def accepted(index):
        seen.append(len(os.listdir("/proc/self/fd")) - before)
        return (1, 1)

    picks = pick_lines(paths, 50, accepted)
    assert max(seen) <= 2 and all(picks.state[i] == 2 for i in range(50))
