"""What a `genq requeue` will do, before it does it: the new version's diff, how many indices
each redo scope touches, how many requests in flight are aborted, and what the redone work
costs in output tokens and time at the current rate. `--dry-run` prints this and stops;
every requeue prints it after acting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from common import params
from common.queue.keys import RunKeys
from common.report.status import read_status
from common.report.status_table import human_duration

# What each --redo mode walks: result bitmaps to undo, then failed prompts to revive.
REDO_PASSES = {"truncated": ("truncated",), "failed": ("failed",), "all": ("done", "failed")}


@dataclass(frozen=True, kw_only=True)
class Plan:
    run: str
    version: int  # the current version
    new_version: int
    diff: dict[str, list[Any]]
    new_params: dict[str, Any]
    redo: str
    inflight: str
    results: int  # finished results the redo sets aside and runs again
    failed: int  # failed prompts the redo makes runnable again
    aborted: int  # requests in flight that are aborted and queued again
    tokens: tuple[int, int]  # extra output tokens, low and high estimate
    tok_per_s: float


def extra_tokens(*, redo: str, results: int, failed: int, aborted: int, mean: float,
                 ctok_sum: int, old_max: int, new_max: int) -> tuple[int, int]:
    """(low, high) output tokens the requeue adds. A truncated result regenerates at least
    its old max_tokens and at most the new one; `all` regenerates about what it has; failed
    prompts and aborted requests about a mean result each."""
    low = high = round((failed + aborted) * mean)
    if redo == "truncated":
        low += results * old_max
        high += results * max(old_max, new_max)
    elif redo == "all":
        low += ctok_sum
        high += round(ctok_sum * max(1.0, new_max / old_max)) if old_max else ctok_sum
    return low, high


def make_plan(r: redis.Redis, k: RunKeys, *, changes: dict[str, Any], unset: list[str],
              redo: str, inflight: str) -> Plan:
    version, old = params.current(r, k)
    new, diff = params.apply(old, changes, unset)
    st = read_status(r, k.run)
    results = {"truncated": st["truncated"], "all": st["done"]}.get(redo, 0)
    failed = st["failed"] if redo in ("failed", "all") else 0
    aborted = st["inflight"] if inflight == "abort" else 0
    old_max = int(old.get("max_tokens", params.DEFAULTS["max_tokens"]))
    new_max = int(new.get("max_tokens", params.DEFAULTS["max_tokens"]))
    tokens = extra_tokens(redo=redo, results=results, failed=failed, aborted=aborted,
                          mean=st["output_tokens"]["mean"] or 0.0,
                          ctok_sum=st["output_tokens_total"], old_max=old_max, new_max=new_max)
    return Plan(run=k.run, version=version, new_version=version + 1, diff=diff,
                new_params=new, redo=redo, inflight=inflight, results=results, failed=failed,
                aborted=aborted, tokens=tokens, tok_per_s=st["rate"]["tok_per_s"])


def _tokens(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k" if n >= 1e4 else str(n)


def _span(low: float, high: float, fmt) -> str:
    return fmt(low) if fmt(low) == fmt(high) else f"{fmt(low)}–{fmt(high)}"


def render(plan: Plan) -> list[str]:
    """The summary, one fact a line."""
    what = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in plan.diff.items())
    lines = [f"run {plan.run!r}: parameters version {plan.new_version}: "
             f"{what or 'no parameter changes'}"]
    if plan.redo in ("truncated", "all"):
        scope = "that ended truncated" if plan.redo == "truncated" else "all"
        lines.append(f"redo {plan.redo}: {plan.results} finished results ({scope}) of older "
                     "versions run again, and any still in flight that end in scope")
    if plan.redo in ("failed", "all"):
        lines.append(f"redo failed: {plan.failed} failed prompts run again")
    if plan.inflight == "abort":
        lines.append(f"in flight: {plan.aborted} requests under older parameters are aborted "
                     "and queued again")
    else:
        lines.append("in flight: requests under older parameters finish and are kept")
    low, high = plan.tokens
    cost = f"cost: about {_span(low, high, _tokens)} extra output tokens"
    if plan.tok_per_s > 0:
        cost += (f", {_span(low / plan.tok_per_s, high / plan.tok_per_s, human_duration)} "
                 f"at the current {plan.tok_per_s:,.0f} tok/s")
    else:
        cost += " (no current rate to turn into time)"
    return [*lines, cost]
