"""Is the new limit enough? The truncation rate of the results produced under the current
parameter version, from the rate buckets (ack.lua counts `vreq|<version>` and
`vlen|<version>`), with a Wilson interval, and the same advice as the run-wide truncation
alert when it is still high."""

from __future__ import annotations

from typing import Any

from common.report import stats
from common.report.confidence import wilson


def version_truncation(buckets: dict[int, dict[str, float]], version: int) -> dict[str, Any]:
    """Completions and truncations under `version` over the buckets read (the last hour)."""
    n = int(sum(b.get(f"vreq|{version}", 0) for b in buckets.values()))
    k = int(sum(b.get(f"vlen|{version}", 0) for b in buckets.values()))
    low, high = wilson(k, n)
    return {"version": version, "completions": n, "truncated": k,
            "rate": round(k / n, 4) if n else None,
            "ci": [round(low, 4), round(high, 4)] if n else None}


def version_alert(vt: dict[str, Any], max_tokens: int | None, run: str, threshold: float,
                  min_samples: float = stats.TRUNCATION_MIN_SAMPLES) -> dict | None:
    """After a pivot: the new version's own truncation rate, if still above the threshold."""
    if vt["version"] <= 1 or vt["completions"] < min_samples or vt["rate"] <= threshold:
        return None
    limit = f"max_tokens={max_tokens}" if max_tokens else "max_tokens"
    low, high = vt["ci"]
    alert: dict = {
        "kind": "truncation",
        "message": (f"{vt['rate']:.0%} (95% CI {low:.0%}-{high:.0%}) of the "
                    f"{vt['completions']} completions under v{vt['version']} ({limit}) still "
                    f"hit the limit (threshold {threshold:.0%}); raise it and redo the "
                    "truncated ones"),
    }
    cmd = stats.requeue_command(max_tokens, run)
    if cmd:
        alert["command"] = cmd
    return alert
