"""Output shards: durable whole-line writes, rotation, torn-tail repair, reading, choosing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
from contextlib import closing
from pathlib import Path

import orjson
import pytest
from export_reference import ReadStats, choose_records, read_records
from hypothesis import given
from hypothesis import strategies as st

from genq.common.data.shard_repair import repair_shards
from genq.common.data.shards import ShardWriter, closed_shards, shard_parts
from genq.common.errors import OutputUnavailable, Retryable

REPO = Path(__file__).resolve().parent.parent


def rec(index: int, version: int = 1, attempt: int = 1, **extra: object) -> dict:
    return {"index": index, "params_version": version, "attempt": attempt, **extra}


def lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n")
    return [orjson.loads(line) for line in data.splitlines()]


def test_writer_names_locks_and_appends(tmp_path):
    out = tmp_path / "out"  # created on demand
    with closing(ShardWriter(out, "run1", "gpu0:30000")) as w:
        path = w.path
        assert path is not None and path.parent == out
        assert path.name.startswith("run1.gpu0_30000.") and path.name.endswith(".jsonl")
        assert f"-{os.getpid()}." in path.name
        w.write_many([rec(0, content="héllo")])
        w.write_many([rec(1)])
        assert lines(path) == [rec(0, content="héllo"), rec(1)]
        assert repair_shards(out, "run1") == []  # held by the writer: left alone
    assert lines(path) == [rec(0, content="héllo"), rec(1)]
    with pytest.raises(ValueError, match="closed"):
        w.write_many([rec(2)])


def test_writes_from_many_threads_never_interleave(tmp_path):
    with closing(ShardWriter(tmp_path, "r", "c")) as w:

        def worker(k: int) -> None:
            for i in range(50):
                w.write_many([rec(k * 1000 + i, content="x" * 5000)])

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = lines(w.path)
    assert sorted(r["index"] for r in got) == sorted(
        k * 1000 + i for k in range(8) for i in range(50)
    )


def test_rotation_closes_every_n_records(tmp_path):
    shipped: list[Path] = []
    w = ShardWriter(tmp_path, "r", "c", rotate_every=3, on_close=shipped.append)
    for i in range(7):
        w.write_many([rec(i)])
    assert len(shipped) == 2
    w.close()
    assert len(shipped) == 3
    assert [len(lines(p)) for p in shipped] == [3, 3, 1]
    assert sorted(tmp_path.glob("r.*.jsonl")) == shipped  # names sort by start time
    assert [r["index"] for r in read_records(tmp_path, "r")] == list(range(7))


def test_an_unused_or_just_rotated_writer_leaves_no_empty_shard(tmp_path):
    ShardWriter(tmp_path, "r", "idle").close()
    shipped: list[Path] = []
    w = ShardWriter(tmp_path, "r", "c", rotate_every=2, on_close=shipped.append)
    w.write_many([rec(0)])
    w.write_many([rec(1)])
    w.close()
    shards = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert shards == [shipped[0].name]  # the dot files are the shard counters


def test_shards_are_numbered_for_good_and_rotate_by_age(tmp_path):
    shipped: list[Path] = []
    w = ShardWriter(tmp_path, "r", "gpu0", rotate_every=1, on_close=shipped.append)
    w.write_many([rec(0)])
    w.close()
    for path in shipped:
        path.unlink()  # shipped and removed: the next writer still takes a new number
    shipped.clear()
    w = ShardWriter(tmp_path, "r", "gpu0", on_close=shipped.append)
    w.write_many([rec(1)])
    w.rotate_if_older(3600)
    assert closed_shards(tmp_path, "r") == []  # young, and held by the writer
    w.rotate_if_older(0)
    assert [shard_parts(p)[::3] for p in closed_shards(tmp_path, "r")] == [("r", "000002")]
    w.rotate_if_older(0)  # nothing written since: no empty shard
    w.close()
    assert len(shipped) == 1


def test_unwritable_output_is_output_unavailable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OutputUnavailable, match=re.escape(f"output directory {blocker}/sub: ")):
        ShardWriter(blocker / "sub", "r", "c")
    assert issubclass(OutputUnavailable, Retryable)


FULL_DISK = textwrap.dedent("""
    import os, resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))
    from genq.common.errors import OutputUnavailable
    from genq.common.data.shards import ShardWriter
    w = ShardWriter(sys.argv[1], "r", "c")
    written = 0
    try:
        for i in range(100):
            w.write_many([{"index": i, "params_version": 1, "attempt": 1, "content": "y" * 300}])
            written += 1
    except OutputUnavailable as e:
        print(written, e, sep="|")
    # After the failure the shard still takes a small record that fits.
    w.write_many([{"index": -1}])
    w.close()
""")


def test_full_disk_leaves_no_torn_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    written, message = proc.stdout.strip().split("|")
    assert message == f"output directory {tmp_path}: File too large"
    [shard] = tmp_path.glob("r.*.jsonl")
    got = lines(shard)  # asserts every line is whole
    assert [r["index"] for r in got] == [*range(int(written)), -1]
    assert 0 < int(written) < 100


FULL_DISK_THREADS = textwrap.dedent("""
    import os, resource, signal, sys, threading
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
    from genq.common.errors import OutputUnavailable
    from genq.common.data.shards import ShardWriter
    w = ShardWriter(sys.argv[1], "r", "c")
    per_call = int(sys.argv[2])  # records per write_many call (consumers write batches)
    written, failed = [], []
    def worker(k):
        for i in range(0, 100, per_call):
            batch = [{"index": k * 1000 + j, "content": "y" * 300} for j in range(i, i + per_call)]
            try:
                w.write_many(batch)
            except OutputUnavailable:
                failed.append(k)
                return
            written.extend(r["index"] for r in batch)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    print(sorted(written), sorted(failed), sep="|")
""")


@pytest.mark.parametrize("per_call", [1, 5])
def test_full_disk_from_many_threads_keeps_exactly_the_records_reported_written(tmp_path,
                                                                                 per_call):
    # Eight threads write at once; when a write does not fit, every record in it is
    # reported failed and cut off again: the shard holds exactly the records whose write()
    # or write_many() returned, each line whole.
    proc = subprocess.run([sys.executable, "-c", FULL_DISK_THREADS, str(tmp_path),
                           str(per_call)],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stderr
    written, failed = (orjson.loads(part) for part in proc.stdout.strip().split("|"))
    [shard] = tmp_path.glob("r.*.jsonl")
    assert sorted(r["index"] for r in lines(shard)) == written
    assert failed == list(range(8)) and 0 < len(written) < 800


def write_raw(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


GOOD = orjson.dumps(rec(0)) + b"\n" + orjson.dumps(rec(1)) + b"\n"


@pytest.mark.parametrize(
    ("tail", "note"),
    [
        (b'{"index": 2, "params_ver', "partial last line"),
        (orjson.dumps(rec(2)), "complete record without its newline"),
        (b'{"index": 2, "oops"}\n', "invalid JSON last line"),
        (b"\x00" * 40, "zeros left by a crash"),
        (b'{"index": 2, "par\n\x00\x00', "two bad lines"),
    ],
)
def test_repair_cuts_torn_tails(tmp_path, tail, note):
    shard = write_raw(tmp_path / "r.c.1-1.jsonl", GOOD + tail)
    assert repair_shards(tmp_path, "r") == [(shard, len(tail))], note
    assert shard.read_bytes() == GOOD
    assert repair_shards(tmp_path, "r") == []  # idempotent


def test_repair_edge_cases(tmp_path):
    empty = write_raw(tmp_path / "r.a.1-1.jsonl", b"")
    garbage = write_raw(tmp_path / "r.b.1-1.jsonl", b"garbage")
    fine = write_raw(tmp_path / "r.c.1-1.jsonl", GOOD)
    other_run = write_raw(tmp_path / "s.c.1-1.jsonl", b"torn")
    long_line = orjson.dumps(rec(5, content="z" * 200_000)) + b"\n"
    long_tail = write_raw(tmp_path / "r.d.1-1.jsonl", long_line + b'{"ind')
    assert repair_shards(tmp_path, "r") == [(garbage, 7), (long_tail, 5)]
    assert (empty.read_bytes(), garbage.read_bytes(), fine.read_bytes()) == (b"", b"", GOOD)
    assert long_tail.read_bytes() == long_line
    assert other_run.read_bytes() == b"torn"


def test_repair_skips_a_shard_a_live_writer_holds(tmp_path):
    shipped: list[Path] = []
    w = ShardWriter(tmp_path, "r", "live", on_close=shipped.append)
    w.write_many([rec(0)])
    with open(w.path, "ab") as f:  # what a torn write in progress looks like from outside
        f.write(b'{"index": 1')
    assert repair_shards(tmp_path, "r") == []
    w.close()
    assert repair_shards(tmp_path, "r") == [(shipped[0], 11)]


def test_read_records_skips_and_counts_torn_lines(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_raw(a / "r.x.1-1.jsonl", GOOD + b'{"torn\n' + b"[1, 2]\n" + orjson.dumps(rec(3)))
    write_raw(b / "r.y.1-1.jsonl", orjson.dumps(rec(4)) + b"\n\n")
    write_raw(b / "other.y.1-1.jsonl", orjson.dumps(rec(9)) + b"\n")
    stats = ReadStats()
    got = list(read_records([a, str(b), tmp_path / "missing"], "r", stats))
    assert [r["index"] for r in got] == [0, 1, 4]
    assert stats == ReadStats(shards=2, records=3, skipped=3)


def test_choose_records_rules():
    records = [
        rec(0, 1, 1, tag="a"),
        rec(0, 2, 1, tag="b"),
        rec(0, 1, 2, tag="c"),
        rec(1, 1, 1, tag="d"),
        rec(1, 1, 3, tag="e"),
        rec(1, 1, 2, tag="f"),
        rec(2, 1, 1, tag="g"),
        rec(2, 1, 1, tag="h"),
        rec(3, 2, 1, tag="i"),
        rec(3, 1, 4, tag="j"),
    ]
    accepted = {3: (1, 4), 1: (9, 9)}  # index 1's accepted attempt is not in the shards
    calls: list[int] = []

    def lookup(index: int):
        calls.append(index)
        return accepted.get(index)

    chosen = choose_records(records, lookup)
    assert {i: r["tag"] for i, r in chosen.items()} == {0: "b", 1: "e", 2: "h", 3: "j"}
    assert sorted(calls) == [0, 1, 2, 3]  # one lookup per index


records_st = st.lists(
    st.builds(
        rec, st.integers(0, 5), st.integers(1, 3), st.integers(1, 3), tag=st.integers(0, 10**6)
    ),
    max_size=40,
)


@given(
    records_st, st.dictionaries(st.integers(0, 5), st.tuples(st.integers(1, 3), st.integers(1, 3)))
)
def test_choose_records_properties(records, accepted):
    chosen = choose_records(records, accepted.get)
    assert set(chosen) == {r["index"] for r in records}
    for index, winner in chosen.items():
        mine = [r for r in records if r["index"] == index]
        assert winner in mine
        pairs = [(r["params_version"], r["attempt"]) for r in mine]
        want = accepted.get(index)
        expected = want if want in pairs else max(pairs)
        assert (winner["params_version"], winner["attempt"]) == expected
        # among equal pairs: the accepted one first read (another is a copy, or ambiguous);
        # the newest otherwise, last seen
        same = [r for r, p in zip(mine, pairs, strict=True) if p == expected]
        assert winner is (same[0] if expected == want else same[-1])


@given(records_st)
def test_choose_records_ignores_order_of_distinct_pairs(records):
    unique = list({(r["index"], r["params_version"], r["attempt"]): r for r in records}.values())
    forward = choose_records(unique, lambda i: None)
    backward = choose_records(list(reversed(unique)), lambda i: None)
    assert forward == backward
