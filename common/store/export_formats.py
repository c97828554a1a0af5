"""`genq export`'s sources and formats: ``--from-s3`` downloads the shards first; ``--format
parquet`` writes typed columns in bounded row groups; ``--format tokens`` the pre-tokenized
lines drafter pipelines read."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import time
from typing import Any

import orjson

from genq.common.errors import GenqError, UsageError
from genq.common.queue import run as runs
from genq.common.store import export
from genq.common.store import export_turns as turns_export
from genq.common.store import s3 as store
from genq.common.task import TaskId

ROW_GROUP_ROWS = 10_000
ROW_GROUP_BYTES = 64 << 20  # a group closes early when its text gets this large

_FIELDS = {  # field -> pyarrow type name; everything else goes into the ``extra`` JSON column
    "index": "int64", "sample": "int32", "turn": "int32", "seed": "int64", "id": "string",
    "run": "string",
    "params_version": "int32",
    "attempt": "int32", "finish_reason": "string", "prompt_tokens": "int64",
    "completion_tokens": "int64", "reasoning_content": "string", "content": "string",
    "server": "string", "model": "string", "latency_s": "float64", "created_at": "float64",
    # A --turns all conversation's last generation: how it ended, why it stopped early.
    "ended": "string", "stopped": "string",
}
# A --token-ids run's ids, as lists of int32 (a vocabulary fits; half the bytes of int64).
_ID_FIELDS = ("prompt_token_ids", "completion_token_ids")


def _row(record: dict[str, Any]) -> dict[str, Any]:
    row = {name: record.get(name) for name in (*_FIELDS, *_ID_FIELDS)}
    if row["id"] is not None and not isinstance(row["id"], str):
        row["id"] = orjson.dumps(row["id"]).decode()  # ids may be numbers in the data set
    extra = {k: v for k, v in record.items() if k not in _FIELDS and k not in _ID_FIELDS}
    row["extra"] = orjson.dumps(extra).decode() if extra else None
    return row


def jsonl_to_parquet(src: str, out: str) -> None:
    """Copy ``src`` (export's JSONL) into the Parquet file ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, size = [], 0
    fields = [pa.field(name, getattr(pa, kind)()) for name, kind in _FIELDS.items()]
    ids = [pa.field(name, pa.list_(pa.int32())) for name in _ID_FIELDS]
    arrow_schema = pa.schema([*fields, *ids, pa.field("extra", pa.string())])
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
FORMATS = ("jsonl", "parquet", "tokens", "conversations")


# --format tokens: one row a generation, as Parquet columns (JSON lines write the same keys).
_TOKEN_FIELDS = {"id": "string", "index": "int64", "sample": "int32", "turn": "int32",
                 "finish_reason": "string", "is_tool_call": "bool_", "ended": "string",
                 "stopped": "string"}


def token_row(rec: dict[str, Any], samples: bool) -> dict[str, Any]:
    """A generation's pre-tokenized row: input_ids the prompt's ids then the completion's,
    loss_mask 0 on the prompt and 1 on the completion (as vLLM's speculators and SpecForge
    read them); its turn, whether it called tools, and on a conversation's last generation
    how it ended, to filter on."""
    prompt, completion = rec.get("prompt_token_ids"), rec.get("completion_token_ids")
    if prompt is None or completion is None:
        raise GenqError(f"index {rec['index']} has no token ids: --format tokens needs a "
                        "run made with `genq produce --token-ids`")
    return {"id": rec.get("id", rec["index"]), "index": rec["index"],
            **({"sample": rec.get("sample", 0)} if samples else {}),
            "turn": tid.turn if (tid := TaskId.read(rec)) else 1,  # as export read it
            "input_ids": prompt + completion,
            "loss_mask": [0] * len(prompt) + [1] * len(completion),
            "finish_reason": rec["finish_reason"], "is_tool_call": bool(rec.get("tool_calls")),
            "ended": rec.get("ended"), "stopped": rec.get("stopped")}


def to_tokens(src: str, out: str, samples: bool, parquet: bool = False) -> None:
    """Copy ``src`` (export's JSONL) into token rows (``token_row``), one per generation, as
    JSON lines or, with ``parquet``, in bounded row groups (ids as int32 lists)."""
    with open(src, "rb") as f:
        rows = (token_row(orjson.loads(line), samples) for line in f)
        if not parquet:
            with open(out, "wb") as w:
                for row in rows:
                    w.write(orjson.dumps(row) + b"\n")
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        fields = [pa.field(name, getattr(pa, kind)()) for name, kind in _TOKEN_FIELDS.items()
                  if samples or name != "sample"]
        arrow_schema = pa.schema([*fields, pa.field("input_ids", pa.list_(pa.int32())),
                                  pa.field("loss_mask", pa.list_(pa.int8()))])
        with pq.ParquetWriter(out, arrow_schema, compression="zstd") as w:
            batch: list[dict[str, Any]] = []
            for row in rows:
                if not isinstance(row["id"], str):
                    row["id"] = orjson.dumps(row["id"]).decode()  # one type: a string
                batch.append(row)
                if len(batch) >= ROW_GROUP_ROWS:
                    w.write_table(pa.Table.from_pylist(batch, schema=arrow_schema))
                    batch = []
            if batch:
                w.write_table(pa.Table.from_pylist(batch, schema=arrow_schema))


def choose_format(out: str, fmt: str | None) -> str:
    """--format, else the one --out's suffix names, else jsonl; a --format the suffix
    contradicts is a usage error (the file's name would lie about its content)."""
    named = SUFFIX_FORMATS.get(os.path.splitext(out)[1].lower())
    lines = named == "jsonl" and fmt in ("tokens", "conversations")  # JSON lines too
    tokens_parquet = (fmt, named) == ("tokens", "parquet")  # token rows as Parquet
    if fmt and named and fmt != named and not lines and not tokens_parquet:
        raise UsageError(f"--format {fmt} contradicts --out {out}, a {named} name: drop "
                         "--format or change the name")
    return fmt or named or "jsonl"


def _identity(path: str) -> str | None:
    """The file at ``path`` as "inode:size:mtime_ns", None if absent: a replaced or edited file
    gets another."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _keep_earlier(r: Any, k: Any, out: str, overwrite: bool) -> str | None:
    """Where a file at ``out`` this run did not write (another run's results: compose's `down
    -v` then `up` registers the run anew under its name; or the user's own) is kept, named by
    its time: a second name for it, so the replace that follows leaves it whole. None when
    there is none, it is this run's own last export, or ``overwrite``."""
    found = _identity(out)
    if found is None or overwrite:
        return None
    mine = r.hget(k.exports, os.path.abspath(out))
    if mine is not None and mine.decode() == found:
        return None
    stem, suffix = os.path.splitext(out)
    when = time.strftime("%Y%m%dT%H%M%S", time.gmtime(os.stat(out).st_mtime))
    n = 1
    while True:
        kept = f"{stem}.earlier-{when}{f'-{n}' if n > 1 else ''}{suffix}"
        try:
            os.link(out, kept)  # no copy, and the earlier name stays until the export is whole
            return kept
        except FileExistsError:
            n += 1
        except OSError:  # a file system without hard links
            if not os.path.exists(kept):
                shutil.copy2(out, kept)
                return kept
            n += 1


def run_export(r: Any, k: Any, total: int, dirs: list[str], out: str, *,
               from_s3: str | None = None, fmt: str = "jsonl", overwrite: bool = False,
               **options: Any) -> tuple[export.ExportResult, str | None]:
    """export.export from ``dirs`` or S3 into JSONL or Parquet; ``options`` are passed on. The
    directory of ``out`` is made if missing, as a consumer makes its --out. An existing ``out``
    this run's last export did not write is kept beside it, unless ``overwrite``: the result,
    and where it was kept."""
    kept = _keep_earlier(r, k, out, overwrite)
    try:
        result = _write(r, k, total, dirs, out, from_s3=from_s3, fmt=fmt, **options)
    except BaseException:
        if kept:
            os.unlink(kept)  # `out` is still the earlier file: one name for it is enough
        raise
    r.hset(k.exports, os.path.abspath(out), _identity(out) or "")
    return result, kept


def _write(r: Any, k: Any, total: int, dirs: list[str], out: str, *,
           from_s3: str | None, fmt: str, **options: Any) -> export.ExportResult:
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    except OSError as e:
        raise GenqError(f"cannot make the directory of --out {out}: {e.strerror}") from None
    with contextlib.ExitStack() as stack:
        if from_s3:
            dirs = [stack.enter_context(tempfile.TemporaryDirectory(prefix="genq-s3-"))]
            store.fetch_run(store.parse_uri(from_s3), k.run, dirs[0])
        write = export.export
        per_turn = options.pop("per_turn", False)
        if runs.load(r, k).turns == runs.ALL:  # one line per generation, or conversations
            write = functools.partial(turns_export.export, conversations=fmt == "conversations",
                                      per_turn=per_turn)
        elif fmt == "conversations":
            raise UsageError("--format conversations needs a run made with `genq produce "
                             "--turns all`; this one makes one answer a row")
        if fmt in ("jsonl", "conversations"):
            return write(r, k, total, dirs, out, **options)
        # Beside `out`, so that the finished file is renamed into place whole.
        tmp = stack.enter_context(tempfile.TemporaryDirectory(
            prefix="genq-export-", dir=os.path.dirname(os.path.abspath(out))))
        jsonl, final = os.path.join(tmp, "export.jsonl"), os.path.join(tmp, "export.final")
        result = write(r, k, total, dirs, jsonl, **options)
        if fmt == "parquet":
            jsonl_to_parquet(jsonl, final)
        else:  # tokens: Parquet by --out's name, as for records
            to_tokens(jsonl, final, runs.samples_of(r, k) > 1,
                      parquet=SUFFIX_FORMATS.get(os.path.splitext(out)[1].lower()) == "parquet")
        os.replace(final, out)
        return result
