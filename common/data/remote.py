"""A data set named ``s3://bucket/key``: copied once per machine into the local cache and read
from there, so its fingerprint is the file's own and rows are read by index at disk speed."""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

from genq.common.errors import DatasetError

_PARTS = 16 << 20  # bytes per ranged GET: few requests, memory bounded by parts x threads
_THREADS = 4


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "genq" / "s3"


def local_copy(uri: str) -> Path:
    """The object's local copy, downloaded when this machine has none of this version (its
    ETag and size name the copy; the run's fingerprint is still checked by the caller).
    Consumers starting together on one machine share one download (a lock file)."""
    from boto3.s3.transfer import TransferConfig

    from genq.common.store import s3 as store

    where = store.parse_uri(uri)
    s3 = store.client()
    with store.as_unavailable(f"reading {uri}"):
        meta = store.head(s3, where, where.prefix) if where.prefix else None
    if meta is None:
        raise DatasetError(f"data set not found: {uri}")
    version = f"{uri}|{meta['ETag']}|{meta['ContentLength']}"
    dest = cache_dir() / (hashlib.sha256(version.encode()).hexdigest()[:24]
                          + "-" + where.prefix.rsplit("/", 1)[-1])
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_name(dest.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.exists() and dest.stat().st_size == meta["ContentLength"]:
            return dest
        tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
        config = TransferConfig(multipart_chunksize=_PARTS, max_concurrency=_THREADS)
        with store.as_unavailable(f"downloading {uri}"):
            s3.download_file(where.bucket, where.prefix, str(tmp), Config=config)
        os.replace(tmp, dest)
    return dest
