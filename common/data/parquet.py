"""Parquet data sets by row index: a row group decoded in C++ (GIL released), converted 1,024
rows at a time, so a read takes milliseconds."""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from itertools import accumulate
from pathlib import Path
from typing import Any

from genq.common.data.rows import Dataset, edge_digest
from genq.common.errors import DatasetError

_ROW_GROUPS_CACHED = 2  # decoded Arrow tables kept (Parquet is read a row group at a time)
_BATCH_ROWS = 1024  # rows converted to Python at once
_BATCHES_CACHED = 64


def _cached(cache: OrderedDict, key: Hashable, make: Callable[[], Any], keep: int) -> Any:
    """cache[key], made when absent; only the `keep` most recently used entries stay."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = make()
    if len(cache) > keep:
        cache.popitem(last=False)
    return value


class ParquetDataset(Dataset):
    def __init__(self, path: Path, fd: int) -> None:
        import pyarrow.parquet as pq

        self.path = path
        self._raw = os.fdopen(fd, "rb")  # owns fd from here on
        try:
            st = os.fstat(fd)
            digest = edge_digest(fd, st.st_size)
            self._file = pq.ParquetFile(self._raw)
        except Exception as e:  # pyarrow raises its own types for a corrupt or foreign file
            self._raw.close()
            raise DatasetError(f"data set {path}: not a readable Parquet file ({e})") from e
        meta = self._file.metadata
        self.total = meta.num_rows
        self.fingerprint = f"{self.total}r-{st.st_size}b-{digest}"
        self._starts = list(accumulate((meta.row_group(i).num_rows
                                        for i in range(meta.num_row_groups)), initial=0))
        names = set(self._file.schema_arrow.names)
        self._columns = [c for c in ("messages", "prompt", "id") if c in names]
        self._tables: OrderedDict[int, Any] = OrderedDict()
        self._batches: OrderedDict[tuple[int, int], dict[str, list[Any]]] = OrderedDict()
        self._lock = threading.Lock()  # one ParquetFile handle: reads must not interleave

    _field_word = "column"

    def _has_prompt_field(self) -> bool:
        return bool({"messages", "prompt"} & set(self._columns))

    def _read(self, group: int) -> Any:
        """One row group as an Arrow table. Callers hold the lock."""
        try:
            return self._file.read_row_group(group, columns=self._columns)
        except Exception as e:  # pyarrow's own error types; the file is at fault
            raise DatasetError(f"data set {self.path}: {e}") from e

    def _batch(self, group: int, first: int) -> dict[str, list[Any]]:
        """Rows first..first+_BATCH_ROWS of a row group as Python values."""
        def convert() -> dict[str, list[Any]]:
            table = _cached(self._tables, group, lambda: self._read(group), _ROW_GROUPS_CACHED)
            rows = table.slice(first, _BATCH_ROWS)
            return {c: rows.column(c).to_pylist() for c in self._columns}

        with self._lock:
            return _cached(self._batches, (group, first), convert, _BATCHES_CACHED)

    def _place(self, index: int) -> tuple[int, int, int]:
        """(row group, offset in it, offset of its batch) of a row."""
        group = bisect.bisect_right(self._starts, index) - 1
        offset = index - self._starts[group]
        return group, offset, offset - offset % _BATCH_ROWS

    def cached(self, index: int) -> bool:
        if not 0 <= index < self.total:
            return True  # prompt() refuses it at once
        group, _, first = self._place(index)
        return (group, first) in self._batches

    def _row(self, index: int) -> Any:
        group, offset, first = self._place(index)
        columns = self._batch(group, first)
        return {c: v[offset - first] for c, v in columns.items() if v[offset - first] is not None}

    def close(self) -> None:
        self._file.close()
        self._raw.close()
