"""S3 for genq: URIs, deterministic keys, compressed and verified uploads, reading shards back;
one attempt per call (the shipper backs off)."""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import io
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import zstandard

from genq.common.data.shards import shard_parts
from genq.common.errors import GenqError, StoreUnavailable, UsageError

# Reading a shard back: a damaged or foreign object.
_READ_ERRORS = (OSError, EOFError, gzip.BadGzipFile, zstandard.ZstdError)
SUFFIX = ".jsonl.zst"
MANIFEST = "manifest.json"  # <prefix>/<run>/<consumer>/manifest.json, one per consumer
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SHARD_KEY = re.compile(r"/([^/]+)/shard-([^/]+)\.jsonl\.(zst|gz)$")


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    prefix: str  # without leading or trailing "/"; may be empty

    def key(self, run: str, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, run, *parts) if p)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse_uri(text: str) -> S3Uri:
    """``s3://bucket/optional/prefix``, or one clear error naming what is wrong."""
    if not text.startswith("s3://"):
        raise UsageError(f"S3 URI {text!r} must look like s3://bucket/prefix")
    bucket, _, prefix = text[5:].partition("/")
    if not _BUCKET.match(bucket):
        raise UsageError(f"S3 URI {text!r}: {bucket!r} is not a valid bucket name")
    return S3Uri(bucket, prefix.strip("/"))


def client(read_timeout: float = 20) -> Any:
    """One boto3 S3 client; thread-safe, so every upload thread shares it."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError

    # One attempt per call: the shipper's own backoff retries, and a partitioned store holds
    # a call (and a stopping consumer) at most 5 + read_timeout s.
    config = Config(connect_timeout=5, read_timeout=read_timeout,
                    retries={"total_max_attempts": 1, "mode": "standard"})
    try:
        return boto3.session.Session().client("s3", config=config)
    except (BotoCoreError, ValueError) as e:  # e.g. AWS_ENDPOINT_URL that is not a URL
        raise UsageError(f"cannot set up the S3 client: {e}") from None


def shard_key(uri: S3Uri, path: Path) -> str:
    """``<prefix>/<run>/<consumer>/shard-<start>-<pid>-000123.jsonl.zst``: a retry writes the
    same object; named by the writing process too, since a replacement reusing a lost node's
    --name on an empty disk numbers its shards from 1 again."""
    run, name, process, seq = shard_parts(path)
    return uri.key(run, name, f"shard-{process}-{seq}{SUFFIX}")


def legacy_shard_key(uri: S3Uri, path: Path) -> str:
    """The key an older genq shipped this shard under (``shard-000123``, per --name alone)."""
    run, name, _, seq = shard_parts(path)
    return uri.key(run, name, f"shard-{seq}{SUFFIX}")


def compress(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(data)


@contextlib.contextmanager
def as_unavailable(what: str) -> Iterator[None]:
    """S3's own errors in the block, raised as StoreUnavailable naming ``what``."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (BotoCoreError, ClientError) as e:
        raise StoreUnavailable(f"{what}: {type(e).__name__}: {e}") from None


def head(s3: Any, uri: S3Uri, key: str) -> dict | None:
    """The object's head, or None when there is none."""
    from botocore.exceptions import ClientError

    try:
        return s3.head_object(Bucket=uri.bucket, Key=key)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def put_verified(s3: Any, uri: S3Uri, key: str, body: bytes, meta: dict[str, str]) -> None:
    """Upload ``body`` (S3 checks its MD5); the head read back must show the same length, MD5 and
    SHA-256."""
    md5 = hashlib.md5(body, usedforsecurity=False)
    sha = hashlib.sha256(body).hexdigest()
    s3.put_object(Bucket=uri.bucket, Key=key, Body=body,
                  ContentMD5=base64.b64encode(md5.digest()).decode(),
                  Metadata={**meta, "sha256": sha})
    got = head(s3, uri, key) or {}
    etag = str(got.get("ETag", "")).strip('"')
    if (got.get("ContentLength") != len(body)
            or got.get("Metadata", {}).get("sha256") != sha
            or (re.fullmatch(r"[0-9a-f]{32}", etag) and etag != md5.hexdigest())):
        raise StoreUnavailable(f"s3://{uri.bucket}/{key}: the stored object does not match "
                               "what was sent (length or checksum)")


def put_manifest(uri: str, run: str, manifest: dict[str, Any]) -> None:
    """Upload a manifest made where no consumer's directory is (`requeue --from-s3`) as
    <prefix>/<run>/requeue/manifest.json: `recover --from-s3` takes the newest of them all."""
    parsed = parse_uri(uri)
    key = parsed.key(run, "requeue", MANIFEST)
    with as_unavailable(f"writing s3://{parsed.bucket}/{key}"):
        put_verified(client(), parsed, key, orjson.dumps(manifest, option=orjson.OPT_INDENT_2),
                     {})


def _run_keys(s3: Any, uri: S3Uri, run: str) -> Iterator[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=uri.bucket,
                                                         Prefix=uri.key(run) + "/")
    for page in pages:
        yield from (o["Key"] for o in page.get("Contents", []))


def shard_keys(s3: Any, uri: S3Uri, run: str) -> list[str]:
    return sorted(key for key in _run_keys(s3, uri, run) if _SHARD_KEY.search(key))


def open_object(s3: Any, uri: S3Uri, key: str) -> Any:
    """A shard object's content, decompressed by its suffix (zstd as genq writes it, or gzip)."""
    body = s3.get_object(Bucket=uri.bucket, Key=key)["Body"]
    if key.endswith(".zst"):
        # Buffered, so that callers can iterate lines (the bare reader cannot readline).
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(body, closefd=True),
                                 1 << 20)
    return gzip.GzipFile(fileobj=body)  # _SHARD_KEY admits no other suffix


def iter_shards(s3: Any, uri: S3Uri, run: str) -> Iterator[tuple[str, str, Any]]:
    """(consumer, shard id, stream of lines) per shard of the run; each closes when the next is
    asked for."""
    with as_unavailable(f"listing {uri}/{run}"):
        keys = shard_keys(s3, uri, run)
    for key in keys:
        match = _SHARD_KEY.search(key)
        assert match is not None  # shard_keys kept only matching keys
        with as_unavailable(f"reading s3://{uri.bucket}/{key}"):
            stream = open_object(s3, uri, key)
        try:
            yield match.group(1), match.group(2), stream
        finally:
            stream.close()


def run_source(uri: str, run: str, parse_manifest: Callable[[bytes, str], Any]
               ) -> tuple[list[Any], Iterator[Any]]:
    """What `genq recover --from-s3` reads: every consumer's shipped manifest (checked by
    ``parse_manifest``) and the run's shards as streams of lines."""
    parsed, s3 = parse_uri(uri), client()
    with as_unavailable(f"reading the manifests under {parsed}/{run}"):
        keys = sorted(key for key in _run_keys(s3, parsed, run) if key.endswith("/" + MANIFEST))
        bodies = [s3.get_object(Bucket=parsed.bucket, Key=key)["Body"].read() for key in keys]
    found = [parse_manifest(body, f"s3://{parsed.bucket}/{key}")
             for key, body in zip(keys, bodies, strict=True)]
    return found, (stream for _, _, stream in iter_shards(s3, parsed, run))


def fetch_run(uri: S3Uri, run: str, dest: str | os.PathLike[str]) -> None:
    """Download the run's shards into ``dest``, laid out like a consumer's output directory."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    path = dest
    try:
        with as_unavailable(f"reading {uri}/{run}"):
            for consumer, shard_id, stream in iter_shards(client(), uri, run):
                path = dest / f"{run}.{consumer}.{shard_id}.jsonl"
                with open(path, "wb") as f:
                    shutil.copyfileobj(stream, f, 1 << 20)
    except _READ_ERRORS as e:
        raise GenqError(f"reading {uri}/{run}: {path.name}: {e}") from None
