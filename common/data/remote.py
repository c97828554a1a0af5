"""A data set named ``s3://bucket/key``: copied once per machine into the local cache and read
from there, so its fingerprint is the file's own and rows are read by index at disk speed.

The copy is a few long ranges, each one streamed GET, not many small parts: S3 serves ranges
in parallel (a stream is ~100 MB/s, four add up), but a store that reads the whole object for
every range (moto) makes many small parts quadratic in the object's size. A dropped stream
resumes by Range from the byte it reached, and so does one that S3 answers with a 5xx or
SlowDown (after a backoff: a fleet starting together is when S3 throttles). Every GET names the
ETag, so a copy is never two versions of the object, and every answer must be the range asked
for (a store that ignores Range would give the right size with the wrong bytes). The run records
the ETag it was registered with, and a node copies that version or refuses."""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog

from genq.common.errors import DatasetError, StoreUnavailable

_STREAMS = 4  # ranges fetched at once
_MIN_RANGE = 64 << 20  # a smaller object, or share of one, is not worth its own stream
_CHUNK = 1 << 20  # bytes read from a stream at once: memory is streams x chunk
_ATTEMPTS = 8  # GETs in a row that move no byte before the download gives up (~30 s of backoff)
# What S3 asks a client to try again after, besides any 5xx.
_RETRY_CODES = ("SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError")
# A store that reads the whole object before a range's first byte (moto: ~20 s for 2.5 GB,
# four at once, on a loaded machine) must not be timed out into reading it again.
_FIRST_BYTE_S = 60

logger = structlog.get_logger("dataset")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "genq" / "s3"


def local_copy(uri: str, version: str | None = None) -> tuple[Path, str]:
    """The object's local copy and its ETag, downloaded when this machine has none of that
    version. `version` is the ETag the run registered: a machine that copied it serves it, and
    one that has no copy refuses when the bucket holds another (the run's fingerprint is still
    checked by the caller). Consumers starting together on one machine share one download."""
    from genq.common.store import s3 as store

    where = store.parse_uri(uri)
    s3 = store.client(read_timeout=_FIRST_BYTE_S)
    with store.as_unavailable(f"reading {uri}"):
        meta = store.head(s3, where, where.prefix) if where.prefix else None
    if meta is None:
        raise DatasetError(f"data set not found: {uri}")
    etag = version or meta["ETag"]
    dest = cache_dir() / (hashlib.sha256(f"{uri}|{etag}".encode()).hexdigest()[:24]
                          + "-" + where.prefix.rsplit("/", 1)[-1])
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_name(dest.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.exists():  # only ever renamed into place whole
            return dest, etag
        if etag != meta["ETag"]:
            raise DatasetError(f"data set {uri} is not the version the run registered (ETag "
                               f"{etag}; the bucket holds {meta['ETag']}) and this machine has "
                               "no copy of it: put that version back, or produce the new one "
                               "under another --run")
        for stale in dest.parent.glob(f"{dest.name}.*.tmp"):  # made only under this lock:
            stale.unlink(missing_ok=True)  # what is left is a killed download's
        tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
        started, size = time.monotonic(), meta["ContentLength"]
        logger.info("dataset_download", uri=uri, mb=round(size / 1e6, 1), to=str(dest))
        try:
            with store.as_unavailable(f"downloading {uri}"):
                _download(s3, where.bucket, where.prefix, etag, size, tmp)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        logger.info("dataset_downloaded", uri=uri, seconds=round(time.monotonic() - started, 1))
    return dest, etag


def _download(s3: Any, bucket: str, key: str, etag: str, size: int, path: Path) -> None:
    """The object into `path`, its ranges streamed at once, each written where it belongs."""
    streams = max(1, min(_STREAMS, size // _MIN_RANGE))
    bounds = [size * i // streams for i in range(streams + 1)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        with ThreadPoolExecutor(streams) as pool:
            for done in [pool.submit(_fetch_range, s3, bucket, key, etag, fd, lo, hi)
                         for lo, hi in zip(bounds, bounds[1:], strict=False)]:
                done.result()  # the first failure, once every stream has ended
    finally:
        os.close(fd)


def _fetch_range(s3: Any, bucket: str, key: str, etag: str, fd: int, lo: int, hi: int) -> None:
    """Bytes lo..hi-1 into fd; a stream that breaks, or a GET that S3 asks to try again, is
    asked again from the byte reached."""
    from botocore.exceptions import BotoCoreError, ClientError

    pos, failures = lo, 0
    while pos < hi:
        reached = pos
        try:
            answer = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={pos}-{hi - 1}",
                                   IfMatch=etag)
            body = answer["Body"]
            with body:
                _check_range(answer.get("ContentRange"), pos, hi, bucket, key)
                for chunk in body.iter_chunks(_CHUNK):
                    view = memoryview(chunk)[:hi - pos]
                    while view:  # pwrite may write less than it was given
                        written = os.pwrite(fd, view, pos)
                        pos, view = pos + written, view[written:]
            if pos < hi:
                raise ConnectionError(f"the stream ended at byte {pos} of {hi}")
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "412"):
                raise DatasetError(f"data set s3://{bucket}/{key} was replaced while it was "
                                   "downloaded: start again to read the new version") from None
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if status < 500 and code not in _RETRY_CODES:
                raise
            failures = _again(e, pos, reached, failures, bucket, key)
        except (BotoCoreError, ConnectionError) as e:
            failures = _again(e, pos, reached, failures, bucket, key)


def _check_range(content_range: str | None, lo: int, hi: int, bucket: str, key: str) -> None:
    """The answer is the range asked for, not the whole object a store that ignores Range sends
    (its bytes would land at the wrong offsets)."""
    if not (content_range or "").startswith(f"bytes {lo}-{hi - 1}/"):
        raise DatasetError(f"data set s3://{bucket}/{key}: the store ignores Range requests "
                           f"(asked for bytes {lo}-{hi - 1}, got "
                           f"{content_range or 'the whole object'}); genq copies a data set by "
                           "ranges: serve it from a store that supports them")


def _again(e: Exception, pos: int, reached: int, failures: int, bucket: str, key: str) -> int:
    """Back off before asking again from `pos`: the failures in a row that moved no byte, or
    StoreUnavailable once there are too many."""
    failures = 0 if pos > reached else failures + 1
    if failures >= _ATTEMPTS:
        raise StoreUnavailable(f"downloading s3://{bucket}/{key}: "
                               f"{type(e).__name__}: {e}") from None
    logger.warning("dataset_download_resumed", key=key, at=pos, error=str(e))
    if failures:  # exponential with jitter: a fleet throttled together comes back apart
        time.sleep(min(10.0, 0.2 * 2 ** failures) * random.uniform(0.5, 1.0))
    return failures
