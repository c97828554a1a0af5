"""The README's first command: `genq demo` runs the whole pipeline and exports every prompt."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, free_port, genq_env
from pipeline import read_jsonl


@pytest.mark.timeout(180)
def test_demo_runs_the_pipeline_end_to_end(tmp_path, redis_url):
    out = tmp_path / "demo.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "genq", "demo", "--prompts", "150", "--time-scale", "400",
         "--monitor-port", str(free_port()), "--out", str(out)],
        env=genq_env(redis_url, "unused"), cwd=REPO, capture_output=True, text=True,
        timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exported 150 records (150 done of 150)" in proc.stdout
    records = read_jsonl(out)
    assert sorted(r["index"] for r in records) == list(range(150))
