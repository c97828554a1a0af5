"""A JSONL or Parquet data set by 0-based row index, as chat prompts. Fingerprint:
``"{rows}r-{size}b-{sha}"`` over the first and last MiB; JSONL offsets are indexed into
``PATH.genq-idx`` (or ``~/.cache/genq/``)."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import struct
import sys
import threading
from array import array
from itertools import accumulate, repeat
from operator import add
from pathlib import Path
from typing import Any

import orjson

from genq.common.data.rows import Dataset, edge_digest
from genq.common.errors import BadTask, DatasetError

_CHUNK = 16 << 20  # read size while indexing: big reads keep the pass I/O-bound
_MAGIC = b"GENQIDX1"
_PROMPT_KEY = re.compile(rb'"(?:messages|prompt)"\s*:')


class JsonlDataset(Dataset):
    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd
        st = os.fstat(fd)
        key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha": edge_digest(fd, st.st_size)}
        candidates = _index_paths(path)
        offsets = _load_index(candidates, key)
        if offsets is None:
            offsets = _build_offsets(fd, st.st_size)
            _store_index(candidates, key, offsets)
        self._offsets = offsets
        self.total = len(offsets) - 1
        self.fingerprint = f"{self.total}r-{key['size']}b-{key['sha']}"

    def _row(self, index: int) -> Any:
        start, end = self._offsets[index], self._offsets[index + 1]
        try:
            # pread: no shared file position, so threads never race on seek + read.
            line = os.pread(self._fd, end - start, start)
        except OSError as e:
            raise DatasetError(f"data set {self.path}: {e.strerror}") from e
        if not line.strip():
            raise BadTask(index, f"row {index}: empty line")
        try:
            return orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise BadTask(index, f"row {index}: not valid JSON ({e})") from None

    _field_word = "key"

    def _has_prompt_field(self) -> bool:
        # One C-speed pass over the file; inside a string a quote is escaped, so only a key (or
        # a malformed line) matches, and a file without a match has no such key anywhere.
        with mmap.mmap(self._fd, self._offsets[-1], prot=mmap.PROT_READ) as data:
            return _PROMPT_KEY.search(data) is not None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _build_offsets(fd: int, size: int) -> array:
    """Start offset of every line plus a final end offset, in one sequential pass."""
    offsets = array("Q", [0])
    pos = 0
    while pos < size:
        chunk = os.pread(fd, min(_CHUNK, size - pos), pos)  # stop at the size we fingerprinted
        if not chunk:
            break
        parts = chunk.split(b"\n")
        # Each part but the last ends at a newline; the next line starts one byte after it.
        starts = accumulate(map(add, map(len, parts[:-1]), repeat(1)), initial=pos)
        next(starts)
        offsets.extend(starts)
        pos += len(chunk)
    if offsets[-1] != pos:
        offsets.append(pos)  # a final line without a newline is still a row
    return offsets


def _index_paths(path: Path) -> list[Path]:
    """Where the index may live, in order of preference."""
    name = hashlib.sha256(str(path).encode()).hexdigest()[:24] + ".genq-idx"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "genq"
    return [path.with_name(path.name + ".genq-idx"), cache / name]


def _load_index(candidates: list[Path], key: dict[str, Any]) -> array | None:
    for candidate in candidates:
        try:
            data = candidate.read_bytes()
            (n,) = struct.unpack_from("<I", data, len(_MAGIC))
            meta = orjson.loads(data[len(_MAGIC) + 4 : len(_MAGIC) + 4 + n])
        except (OSError, struct.error, orjson.JSONDecodeError):
            continue  # absent or unreadable: try the next place, or rebuild
        count = meta.get("count") if isinstance(meta, dict) else None
        if meta != {**key, "count": count, "byteorder": sys.byteorder}:
            continue  # another version of the file, or another machine's byte order
        body = memoryview(data)[len(_MAGIC) + 4 + n :]
        if not isinstance(count, int) or len(body) != 8 * count:
            continue  # a torn or foreign file: rebuild rather than trust it
        offsets = array("Q")
        offsets.frombytes(body)
        if offsets and offsets[-1] == key["size"]:
            return offsets
    return None


def _store_index(candidates: list[Path], key: dict[str, Any], offsets: array) -> None:
    """Write the index to the first writable place; an index is an optimisation, never fatal."""
    meta = orjson.dumps({**key, "count": len(offsets), "byteorder": sys.byteorder})
    for candidate in candidates:
        # A private temp name + rename: consumers building at once each publish a whole file.
        tmp = candidate.with_name(f"{candidate.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            candidate.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_MAGIC + struct.pack("<I", len(meta)) + meta)
                offsets.tofile(f)
            os.replace(tmp, candidate)
            return
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()


def open_dataset(path: str | os.PathLike[str], version: str | None = None) -> Dataset:
    """Open a data set (a path, or ``s3://bucket/key`` read from this machine's copy of the
    object's `version`, the ETag a run registered, else of the bucket's); Parquet by suffix or
    magic bytes, JSON lines otherwise."""
    etag = None
    if str(path).startswith("s3://"):
        from genq.common.data.remote import local_copy

        path, etag = local_copy(str(path), version)
    p = Path(path).expanduser().absolute()
    if p.is_dir():
        raise DatasetError(f"data set {p}: is a directory")
    try:
        fd = os.open(p, os.O_RDONLY)
    except FileNotFoundError:
        raise DatasetError(f"data set not found: {p}") from None
    except OSError as e:
        raise DatasetError(f"data set {p}: {e.strerror}") from None
    try:
        if p.suffix == ".parquet" or os.pread(fd, 4, 0) == b"PAR1":
            from genq.common.data.parquet import ParquetDataset  # pyarrow only when needed

            ds: Dataset = ParquetDataset(p, fd)  # takes the fd, closes it if it fails
        else:
            ds = JsonlDataset(p, fd)
        ds.version = etag
        return ds
    except OSError as e:
        os.close(fd)
        raise DatasetError(f"data set {p}: {e.strerror}") from None
