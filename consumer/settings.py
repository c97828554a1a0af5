"""The consumer's settings, parsed once from flags and environment by consumer/cli.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ConsumeSettings:
    redis_url: str
    run: str
    server: str
    concurrency: int | None
    visibility_timeout: float
    out: str
    burst: bool
    max_attempts: int
    max_claims: int = 30  # claims of a task, whatever their outcome, before it fails
    request_timeout: float
    grace: float
    name: str
    poll: float
    server_wait: float
    redis_wait: float = 30.0  # --burst gives up on an unreachable Redis after this
    stall_timeout: float = 60.0
    stream: bool = False  # answers streamed (per-answer silence) or whole (less server work)
    servers: tuple[str, ...] = ()  # those it may drive; `server` is the one leased, once serving
    # `server` as the cluster knows it (servers.identity): leases, records, status, heartbeats.
    server_id: str = ""
    server_lease: float = 15.0
    max_retry_after: float = 60.0  # the longest a server's Retry-After pauses new requests
    share_server: bool = False
    s3_uri: str | None = None  # shipping to S3 (common/store/ship.py) is off without one
    shard_records: int = 500
    shard_minutes: float = 10.0
    keep_local: bool = True
    ship_wait: float = 600.0
