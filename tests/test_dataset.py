"""Data set access: JSONL and Parquet rows as prompts, bad rows as BadTask, the offsets index."""

from __future__ import annotations

import os
import pickle
import threading
from contextlib import closing
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genq.common.data.dataset import open_dataset
from genq.common.data.rows import Prompt
from genq.common.errors import BadTask, DatasetError, GenqError

MSG = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def write_jsonl(path: Path, rows: list[object], trailing_newline: bool = True) -> Path:
    lines = [r if isinstance(r, bytes) else orjson.dumps(r) for r in rows]
    path.write_bytes(b"\n".join(lines) + (b"\n" if trailing_newline else b""))
    return path


@pytest.fixture
def idx_dir(tmp_path, monkeypatch) -> Path:
    """Keep indexes away from ~/.cache even if a test's data set directory is not writable."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def test_jsonl_messages_prompt_and_ids(idx_dir):
    path = write_jsonl(
        idx_dir / "d.jsonl",
        [
            {"id": "a1", "messages": MSG},
            {"prompt": "tell me a joke", "id": 7},
            {"prompt": "no id"},
        ],
    )
    with closing(open_dataset(path)) as ds:
        assert ds.total == 3
        assert ds.prompt(0) == Prompt(0, MSG, "a1")
        assert ds.prompt(1) == Prompt(1, [{"role": "user", "content": "tell me a joke"}], 7)
        assert ds.prompt(2).id is None
        assert ds.prompt(2).messages == [{"role": "user", "content": "no id"}]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "row 1: not valid JSON ("),
        (b'{"text": "x"}', "row 1: has neither 'messages' nor 'prompt'"),
        (b'["a", "b"]', "row 1: not a JSON object"),
        (b'"just a string"', "row 1: not a JSON object"),
        (b'{"messages": []}', "row 1: 'messages' is not a non-empty list"),
        (b'{"messages": [{"content": "no role"}]}', "row 1: 'messages' is not a non-empty list"),
        (b'{"prompt": 42}', "row 1: 'prompt' is not a string"),
        (b'{"prompt": "x", "id": {"a": 1}}', "row 1: 'id' must be a string or an integer"),
        (b"", "row 1: empty line"),
    ],
)
def test_bad_rows_are_bad_tasks_naming_the_row(idx_dir, raw, reason):
    path = write_jsonl(idx_dir / "d.jsonl", [{"prompt": "ok"}, raw, {"prompt": "after"}])
    with closing(open_dataset(path)) as ds:
        assert ds.total == 3
        with pytest.raises(BadTask) as info:
            ds.prompt(1)
        assert info.value.index == 1
        assert str(info.value).startswith(reason)
        assert ds.prompt(2).messages[0]["content"] == "after"  # neighbours unaffected


def test_out_of_range_is_a_bad_task(idx_dir):
    with closing(open_dataset(write_jsonl(idx_dir / "d.jsonl", [{"prompt": "x"}]))) as ds:
        for index in (1, -1, 10**12):
            with pytest.raises(BadTask, match="out of range"):
                ds.prompt(index)


def test_bad_task_survives_pickling():
    err = pickle.loads(pickle.dumps(BadTask(3, "row 3: has neither 'messages' nor 'prompt'")))
    assert (err.index, str(err)) == (3, "row 3: has neither 'messages' nor 'prompt'")


def test_trailing_lines(idx_dir):
    path = write_jsonl(idx_dir / "a.jsonl", [{"prompt": "1"}, {"prompt": "2"}], False)
    with closing(open_dataset(path)) as ds:
        assert ds.total == 2  # a final line without newline is a row
        assert ds.prompt(1).messages[0]["content"] == "2"
    path = write_jsonl(idx_dir / "b.jsonl", [{"prompt": "1"}, {"prompt": "2"}], True)
    with closing(open_dataset(path)) as ds:
        assert ds.total == 2  # the empty "line" after the final newline is not
    (idx_dir / "c.jsonl").write_bytes(b"")
    with closing(open_dataset(idx_dir / "c.jsonl")) as ds:
        assert ds.total == 0


def test_rows_spanning_read_chunks(idx_dir, monkeypatch):
    monkeypatch.setattr("genq.common.data.dataset._CHUNK", 7)  # every line crosses a chunk boundary
    rows = [{"prompt": "p" * (i % 13), "id": i} for i in range(200)]
    with closing(open_dataset(write_jsonl(idx_dir / "d.jsonl", rows))) as ds:
        assert ds.total == 200
        assert [ds.prompt(i).id for i in range(200)] == list(range(200))


def test_missing_or_unreadable_data_set(tmp_path):
    with pytest.raises(DatasetError, match="data set not found: .*nope.jsonl"):
        open_dataset(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="is a directory"):
        open_dataset(tmp_path)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 but not really")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        open_dataset(tmp_path / "bad.parquet")
    assert issubclass(DatasetError, GenqError)


def test_index_is_reused_then_rebuilt_when_the_file_changes(idx_dir):
    path = write_jsonl(idx_dir / "d.jsonl", [{"prompt": str(i)} for i in range(50)])
    index = idx_dir / "d.jsonl.genq-idx"
    with closing(open_dataset(path)) as ds:
        first = ds.fingerprint
    stamp = index.stat().st_mtime_ns
    os.utime(index, ns=(stamp - 10**9, stamp - 10**9))  # so a rewrite would show
    stamp = index.stat().st_mtime_ns
    with closing(open_dataset(path)) as ds:
        assert ds.fingerprint == first and ds.total == 50
    assert index.stat().st_mtime_ns == stamp

    write_jsonl(path, [{"prompt": "new " + str(i)} for i in range(60)])
    with closing(open_dataset(path)) as ds:
        assert ds.total == 60
        assert ds.fingerprint != first
        assert ds.prompt(59).messages[0]["content"] == "new 59"
    assert index.stat().st_mtime_ns != stamp


def test_corrupt_index_is_rebuilt(idx_dir):
    path = write_jsonl(idx_dir / "d.jsonl", [{"prompt": str(i)} for i in range(5)])
    open_dataset(path).close()
    index = idx_dir / "d.jsonl.genq-idx"
    index.write_bytes(index.read_bytes()[:-5])
    with closing(open_dataset(path)) as ds:
        assert [ds.prompt(i).messages[0]["content"] for i in range(5)] == list("01234")


def test_falls_back_to_the_cache_when_beside_is_impossible(idx_dir):
    path = write_jsonl(idx_dir / "d.jsonl", [{"prompt": "x"}] * 4)
    (idx_dir / "d.jsonl.genq-idx").mkdir()  # as good as an unwritable directory, even for root
    with closing(open_dataset(path)) as ds:
        assert ds.total == 4
    [cached] = (idx_dir / "cache" / "genq").glob("*.genq-idx")
    stamp = cached.stat().st_mtime_ns
    with closing(open_dataset(path)) as ds:
        assert ds.prompt(3).messages == [{"role": "user", "content": "x"}]
    assert cached.stat().st_mtime_ns == stamp
    assert not list((idx_dir / "cache" / "genq").glob("*.tmp"))


def test_consumers_building_the_index_at_once(idx_dir):
    path = write_jsonl(idx_dir / "d.jsonl", [{"prompt": str(i)} for i in range(5000)])
    totals: list[int] = []

    def opener() -> None:
        with closing(open_dataset(path)) as ds:
            totals.append(ds.total)

    threads = [threading.Thread(target=opener) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert totals == [5000] * 6
    assert sorted(p.name for p in idx_dir.iterdir() if p.is_file()) == [
        "d.jsonl",
        "d.jsonl.genq-idx",
    ]


def test_fingerprint_same_for_same_content(idx_dir):
    rows = [{"prompt": str(i)} for i in range(10)]
    a = write_jsonl(idx_dir / "a.jsonl", rows)
    b = write_jsonl(idx_dir / "b.jsonl", rows)
    with closing(open_dataset(a)) as da, closing(open_dataset(b)) as db:
        assert da.fingerprint == db.fingerprint
        da.verify(db.fingerprint)
        with pytest.raises(DatasetError, match="changed since the run was registered"):
            da.verify("0r-0b-x")


def test_concurrent_reads_from_threads(idx_dir):
    rows = [{"prompt": "p" * (i % 50), "id": i} for i in range(2000)]
    errors: list[object] = []
    with closing(open_dataset(write_jsonl(idx_dir / "d.jsonl", rows))) as ds:

        def reader(offset: int) -> None:
            for i in range(offset, 2000, 7):
                p = ds.prompt(i)
                if p.id != i or len(p.messages[0]["content"]) != i % 50:
                    errors.append(i)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


def write_parquet(path: Path, table: pa.Table, row_group_size: int) -> Path:
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def test_parquet_rows_across_row_groups(tmp_path):
    n = 25
    table = pa.table(
        {
            "id": [f"r{i}" for i in range(n)],
            "messages": [[{"role": "user", "content": f"q{i}"}] for i in range(n)],
        }
    )
    with closing(open_dataset(write_parquet(tmp_path / "d.parquet", table, 4))) as ds:
        assert ds.total == n
        order = [24, 0, 5, 6, 23, 11, 12, 3]  # backwards, forwards, across group edges
        for i in order:
            p = ds.prompt(i)
            assert (p.index, p.id, p.messages) == (
                i,
                f"r{i}",
                [{"role": "user", "content": f"q{i}"}],
            )
        with pytest.raises(BadTask, match="out of range"):
            ds.prompt(n)


def test_parquet_prompt_column_nulls_and_missing_fields(tmp_path):
    table = pa.table(
        {
            "prompt": ["hello", None, "third"],
            "id": pa.array([1, 2, None], type=pa.int64()),
        }
    )
    with closing(open_dataset(write_parquet(tmp_path / "p.parquet", table, 2))) as ds:
        assert ds.prompt(0) == Prompt(0, [{"role": "user", "content": "hello"}], 1)
        with pytest.raises(BadTask, match="row 1: has neither 'messages' nor 'prompt'"):
            ds.prompt(1)
        assert ds.prompt(2).id is None

    other = pa.table({"text": ["a", "b"]})
    with closing(open_dataset(write_parquet(tmp_path / "t.parquet", other, 1))) as ds:
        assert ds.total == 2
        with pytest.raises(BadTask, match="row 0: has neither"):
            ds.prompt(0)


def test_parquet_detected_by_magic_and_fingerprint_changes(tmp_path):
    table = pa.table({"prompt": ["a", "b", "c"]})
    path = write_parquet(tmp_path / "data.bin", table, 2)
    with closing(open_dataset(path)) as ds:
        assert ds.total == 3 and ds.prompt(2).messages[0]["content"] == "c"
        before = ds.fingerprint
    write_parquet(path, pa.table({"prompt": ["a", "b", "c", "d"]}), 2)
    with closing(open_dataset(path)) as ds:
        assert ds.fingerprint != before
