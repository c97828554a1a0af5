"""A short run of the seeded chaos soak (bench/chaos.py): random consumer kills, stops and
pauses, Redis kills with AOF restarts, server faults and restarts, requeues. Its checks must
all hold; its timings are figures for docs/RELIABILITY.md, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_smoke_keeps_every_promise(tmp_path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, "bench/chaos.py", "--prompts", "500", "--faults", "8", "--fault-every",
         "1", "--seed", "7", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=280)
    result = json.loads(out.read_text()) if out.exists() else {}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["faults_total"] == 8
    assert result["checks"] and all(result["checks"].values()), result["checks"]
    assert (result["done"], result["failed"]) == (495, 5)  # the 5 poison rows, nothing else
