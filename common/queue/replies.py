"""Redis replies as genq reads them. Every client genq makes keeps redis-py's default
``decode_responses=False``, so a string reply is bytes; redis-py's annotations cannot know
that and say ``bytes | str``. These narrow a reply where it is read (one isinstance each),
so that mypy checks what is done with it."""

from __future__ import annotations


def text(value: bytes | str) -> str:
    """A string reply (a hash field or value, a set member) as text."""
    return value.decode() if isinstance(value, bytes) else value


def blob(value: bytes | str | None) -> bytes:
    """A string reply as bytes (a bitmap, a JSON document); b"" for a missing key."""
    return value.encode() if isinstance(value, str) else value or b""
