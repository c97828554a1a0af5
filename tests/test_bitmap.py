"""common/queue/bitmap.py reads bitmaps in Redis's bit order (bit 0 is the high bit of byte 0)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from genq.common.queue import bitmap

raws = st.one_of(st.none(), st.binary(max_size=40))


def naive(raw: bytes | None) -> list[int]:
    raw = raw or b""
    return [i for i in range(len(raw) * 8) if raw[i // 8] >> (7 - i % 8) & 1]


@given(raws, st.integers(0, 400))
def test_readers_agree_with_the_bit_order(raw, total):
    ones = naive(raw)
    assert list(bitmap.set_indices(raw)) == ones
    assert list(bitmap.set_indices(raw, below=total)) == [i for i in ones if i < total]
    assert list(bitmap.clear_indices(raw, total)) == [i for i in range(total) if i not in ones]
    assert [i for i in range(total) if bitmap.is_set(raw, i)] == [i for i in ones if i < total]


@given(st.lists(raws, max_size=3), st.integers(0, 400))
def test_union_and_encode(parts, total):
    merged = bitmap.union(parts, total)
    assert len(merged) == (total + 7) // 8
    want = sorted({i for raw in parts for i in naive(raw) if i < total})
    assert list(bitmap.set_indices(merged, below=total)) == want
    assert list(bitmap.clear_indices(merged, total)) == sorted(set(range(total)) - set(want))
    encoded = bitmap.encode(want, total)
    assert len(encoded) == len(merged) and list(bitmap.set_indices(encoded)) == want


def test_redis_agrees(r, run_name):
    key = f"genq:{run_name}:bitmap-test"
    for i in (0, 7, 8, 21):
        r.setbit(key, i, 1)
    raw = r.get(key)
    assert list(bitmap.set_indices(raw)) == [0, 7, 8, 21]
    assert bitmap.encode([0, 7, 8, 21], 22) == raw
    r.delete(key)
