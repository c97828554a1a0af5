"""Files genq writes whole (the demo's data set, run manifests, the progress file) are readable
by the other users its services may run as, not private to their writer."""

from __future__ import annotations

from genq.common.files import write_atomic


def test_a_file_written_whole_is_readable_by_all(tmp_path):
    path = tmp_path / "sub" / "prompts.jsonl"
    write_atomic(path, b'{"prompt": "hi"}\n', durable=True)
    assert path.read_bytes() == b'{"prompt": "hi"}\n'
    assert path.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["prompts.jsonl"]  # no temp file left
