"""`genq export`'s sources and formats: ``--from-s3`` downloads the shards first; ``--format
parquet`` writes typed columns in bounded row groups."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import orjson

from genq.common.errors import GenqError, UsageError
from genq.common.store import export
from genq.common.store import s3 as store

ROW_GROUP_ROWS = 10_000
ROW_GROUP_BYTES = 64 << 20  # a group closes early when its text gets this large

_FIELDS = {  # field -> pyarrow type name; everything else goes into the ``extra`` JSON column
    "index": "int64", "sample": "int32", "seed": "int64", "id": "string", "run": "string",
    "params_version": "int32",
    "attempt": "int32", "finish_reason": "string", "prompt_tokens": "int64",
    "completion_tokens": "int64", "reasoning_content": "string", "content": "string",
    "server": "string", "model": "string", "latency_s": "float64", "created_at": "float64",
}


def _row(record: dict[str, Any]) -> dict[str, Any]:
    row = {name: record.get(name) for name in _FIELDS}
    if row["id"] is not None and not isinstance(row["id"], str):
        row["id"] = orjson.dumps(row["id"]).decode()  # ids may be numbers in the data set
    extra = {k: v for k, v in record.items() if k not in _FIELDS}
    row["extra"] = orjson.dumps(extra).decode() if extra else None
    return row


def jsonl_to_parquet(src: str, out: str) -> None:
    """Copy ``src`` (export's JSONL) into the Parquet file ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, size = [], 0
    fields = [pa.field(name, getattr(pa, kind)()) for name, kind in _FIELDS.items()]
    arrow_schema = pa.schema([*fields, pa.field("extra", pa.string())])
    with open(src, "rb") as f, pq.ParquetWriter(out, arrow_schema, compression="zstd") as w:
        for line in f:
            rows.append(_row(orjson.loads(line)))
            size += len(line)
            if len(rows) >= ROW_GROUP_ROWS or size >= ROW_GROUP_BYTES:
                w.write_table(pa.Table.from_pylist(rows, schema=arrow_schema))
                rows, size = [], 0
        if rows:
            w.write_table(pa.Table.from_pylist(rows, schema=arrow_schema))


# An --out ending so names its format; any other suffix is JSONL unless --format says otherwise.
SUFFIX_FORMATS = {".jsonl": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


def choose_format(out: str, fmt: str | None) -> str:
    """--format, else the one --out's suffix names, else jsonl; a --format the suffix
    contradicts is a usage error (the file's name would lie about its content)."""
    named = SUFFIX_FORMATS.get(os.path.splitext(out)[1].lower())
    if fmt and named and fmt != named:
        raise UsageError(f"--format {fmt} contradicts --out {out}, a {named} name: drop "
                         "--format or change the name")
    return fmt or named or "jsonl"


def run_export(r: Any, k: Any, total: int, dirs: list[str], out: str, *,
               from_s3: str | None = None, fmt: str = "jsonl",
               **options: Any) -> export.ExportResult:
    """export.export from ``dirs`` or S3 into JSONL or Parquet; ``options`` are passed on. The
    directory of ``out`` is made if missing, as a consumer makes its --out."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    except OSError as e:
        raise GenqError(f"cannot make the directory of --out {out}: {e.strerror}") from None
    with contextlib.ExitStack() as stack:
        if from_s3:
            dirs = [stack.enter_context(tempfile.TemporaryDirectory(prefix="genq-s3-"))]
            store.fetch_run(store.parse_uri(from_s3), k.run, dirs[0])
        if fmt == "jsonl":
            return export.export(r, k, total, dirs, out, **options)
        # Beside `out`, so that the finished file is renamed into place whole.
        tmp = stack.enter_context(tempfile.TemporaryDirectory(
            prefix="genq-export-", dir=os.path.dirname(os.path.abspath(out))))
        jsonl, parquet = os.path.join(tmp, "export.jsonl"), os.path.join(tmp, "export.parquet")
        result = export.export(r, k, total, dirs, jsonl, **options)
        jsonl_to_parquet(jsonl, parquet)
        os.replace(parquet, out)
        return result
