"""consumer/batch.py: calls from many slots become few flushes, each caller gets its own
result or its flush's error, and a cancelled caller breaks nobody else."""

from __future__ import annotations

import asyncio

import pytest

from consumer.batch import Batcher


def test_concurrent_calls_share_flushes_and_get_their_own_results():
    flushed: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        flushed.append(items)
        await asyncio.sleep(0.01)  # a round trip: the calls made meanwhile wait for the next
        return [item * 10 for item in items]

    async def main() -> list[int]:
        batcher = Batcher(flush, limit=8)
        first = await asyncio.gather(*(batcher(i) for i in range(20)))
        alone = await batcher(99)
        return [*first, alone]

    got = asyncio.run(main())
    assert got == [i * 10 for i in range(20)] + [990]
    assert flushed[:3] == [list(range(8)), list(range(8, 16)), list(range(16, 20))]
    assert flushed[3] == [99] and len(flushed) == 4


def test_a_failed_flush_fails_its_callers_and_the_next_flush_runs():
    calls = 0

    async def flush(items: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("redis went away")
        return items

    async def main() -> tuple[list, int]:
        batcher = Batcher(flush)
        got = await asyncio.gather(*(batcher(i) for i in range(3)), return_exceptions=True)
        return got, await batcher(7)

    got, after = asyncio.run(main())
    assert all(isinstance(e, ConnectionError) for e in got) and after == 7


def test_a_cancelled_caller_leaves_the_others_their_results():
    async def flush(items: list[int]) -> list[int]:
        await asyncio.sleep(0.05)
        return items

    async def main() -> list[int]:
        batcher = Batcher(flush)
        doomed = asyncio.create_task(batcher(1))
        others = [asyncio.create_task(batcher(i)) for i in (2, 3)]
        await asyncio.sleep(0.01)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        return [await t for t in others]

    assert asyncio.run(main()) == [2, 3]
