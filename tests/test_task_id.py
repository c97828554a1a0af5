"""A task's identity (row, sample, turn) read from a record one way, by export, recover and
the consumer alike: rows as logs hold them (a null turn, a float index from a JSON tool's
rewrite) read as genq meant them, and what genq never writes (turn 0, a string) is no task."""

from __future__ import annotations

import orjson
import pytest

from genq.common.data import recovery_turns
from genq.common.task import TaskId

LINE = {"index": 3, "sample": 1, "turn": 2, "params_version": 1, "attempt": 1,
        "finish_reason": "stop", "completion_tokens": 5, "prompt_tokens": 7}


@pytest.mark.parametrize(("fields", "read"), [
    ({}, TaskId(3, 1, 2)),
    ({"turn": None}, TaskId(3, 1, 1)),  # a null column: a record without turns, the one answer
    ({"turn": 0}, None),  # turns count from 1: reading 0 as 1 would let it stand for turn 1
    ({"turn": -1}, None),
    ({"turn": "2"}, None),
    ({"turn": True}, None),
    ({"turn": 2.0}, TaskId(3, 1, 2)),  # a JSON tool's float of a whole number
    ({"turn": 1.5}, None),
    ({"sample": None}, TaskId(3, 0, 2)),
    ({"index": 3.0}, TaskId(3, 1, 2)),
    ({"index": 3.7}, None),
    ({"index": "3"}, None),
    ({"index": -1}, None),
])
def test_one_reading_of_a_task_from_a_record(fields, read):
    rec = {**LINE, **fields}
    assert TaskId.read(rec) == read
    # recover's reader of a conversation's lines reads it the same way
    got = recovery_turns._read(orjson.dumps(rec) + b"\n", samples=2, total=100)
    assert (None if got is None else TaskId(*divmod(got[0], 2), got[1])) == read


def test_a_task_number_and_back():
    assert TaskId.of(7, samples=2, turn=3) == TaskId(3, 1, 3)
    assert TaskId(3, 1, 3).task(samples=2) == 7
    assert TaskId.of(7, samples=1).fields(samples=1) == {"index": 7}
    assert TaskId.of(7, samples=2).fields(samples=2) == {"index": 3, "sample": 1}
