"""Redis replies narrowed for mypy: genq's clients keep ``decode_responses=False``, so a string
reply is bytes, though redis-py's annotations say ``bytes | str``."""

from __future__ import annotations


def text(value: bytes | str) -> str:
    """A string reply (a hash field or value, a set member) as text."""
    return value.decode() if isinstance(value, bytes) else value


def blob(value: bytes | str | None) -> bytes:
    """A string reply as bytes (a bitmap, a JSON document); b"" for a missing key."""
    return value.encode() if isinstance(value, str) else value or b""
