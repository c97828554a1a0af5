"""A short run of the chaos soak on conversations (`bench/chaos.py --turns all`): agentic rows and
malformed ones, 2 samples, token ids, shipped to S3 (moto), through a consumer SIGKILLed and one
stopped with SIGTERM, Redis lost outright and rebuilt by `genq recover`, `genq requeue --inflight
abort`, and a lost node (SIGKILLed, its --out deleted) repaired by `genq requeue --redo missing
--from-s3`. Its checks must all hold: nothing lost, every conversation's turns 1..m once in the S3
export, the malformed rows failed alone with their reasons, `genq status` == the export."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_conversations_keep_every_promise_through_every_fault(tmp_path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, "bench/chaos.py", "--turns", "all", "--prompts", "30", "--servers", "2",
         "--faults", "6", "--fault-every", "2", "--request-s", "0.2", "--seed", "5", "--json",
         str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=280)
    result = json.loads(out.read_text()) if out.exists() else {}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["checks"] and all(result["checks"].values()), result["checks"]
    # Each kind at least once (the first five faults are one of each).
    assert set(result["faults"]) == {"consumer_kill", "consumer_term", "redis_loss", "requeue",
                                     "lost_node"}, result["faults"]
    assert len(result["recovers"]) >= 1 and result["lost_nodes"] >= 1
    again = re.search(r"redo missing: (\d+) conversations made again", result["repair"])
    # The repair ran; what it makes again is what the lost node had not shipped, which timing
    # decides (0 in one CI run: all shipped). tests/test_conversations_lost_node.py loses some
    # for sure; here the checks above (every conversation whole) are the promise.
    assert again, result["repair"]
    # 33 rows (30 and 3 malformed) x 2 samples: the malformed ones' 6 failed, nothing else.
    assert (result["done"], result["failed"]) == (60, 6)
    assert result["generations"] == result["status"]["generations"] > 60
