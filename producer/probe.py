"""`genq requeue --probe N`: try a pivot on a sample, calling the consumers' servers directly, so
no result, counter or shard is touched."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from statistics import fmean
from typing import Any, cast

import redis

from genq.common import params
from genq.common.data.dataset import open_dataset
from genq.common.errors import UsageError
from genq.common.queue import bitmap, heartbeats
from genq.common.queue.keys import RunKeys
from genq.common.queue.replies import blob
from genq.common.queue.run import RunInfo
from genq.common.report.stats import percentiles, wilson
from genq.common.report.status import read_status
from genq.common.sglang.client import SGLang
from genq.common.sglang.continuation import continue_answer
from genq.common.task import Request

POPULATIONS = {**params.REDO_PASSES, "none": ("truncated",)}


def population(r: redis.Redis, k: RunKeys, mode: str) -> list[int]:
    """The prompts the committed pivot would run again (with --redo none: the truncated)."""
    found: set[int] = set()
    for what in POPULATIONS[mode]:
        found.update(bitmap.set_indices(blob(r.get(getattr(k, what)))))
    return sorted(found)


def old_tokens(r: redis.Redis, k: RunKeys, indices: list[int]) -> list[int]:
    """completion_tokens of each index's accepted result (0 where none)."""
    if not indices:
        return []
    field = r.bitfield(k.acc_tokens)
    for i in indices:
        field.get("u32", f"#{i}")
    # One integer per GET; redis-py types execute() for async clients too (an Awaitable).
    return [int(v) for v in cast(list[int], field.execute())]


async def ask_all(servers: list[str], jobs: list[tuple[int, Any]], new: dict[str, Any],
                  concurrency: int, partials: dict[int, dict] | None = None,
                  ) -> tuple[dict[int, Any], list[str]]:
    """Run each (index, prompt) on the servers, `concurrency` at a time each; one in `partials`
    is continued."""
    answers: dict[int, Any] = {}
    errors: list[str] = []

    async def one(server: SGLang, model: str, gate: asyncio.Semaphore, index: int,
                  prompt: Any) -> None:
        request = Request(messages=prompt.messages, params=new, model=model)
        async with gate:
            try:
                partial = (partials or {}).get(index)
                whole = partial and await continue_answer(
                    lambda b: server.chat(b, index), request, partial, server)
                answers[index] = whole or await server.chat(request.body(), index)
            except Exception as e:  # one failed probe request is reported, not fatal
                errors.append(f"index {index}: {e}")

    clients = [SGLang(url, request_timeout=3600.0, connections=concurrency) for url in servers]
    try:
        slots = [(c, await c.model(), asyncio.Semaphore(concurrency)) for c in clients]
        await asyncio.gather(*(one(*slots[n % len(slots)], i, p)
                               for n, (i, p) in enumerate(jobs)))
    finally:
        for c in clients:
            await c.close()
    return answers, errors


def run_probe(r: redis.Redis, k: RunKeys, info: RunInfo, *, n: int, changes: dict[str, Any],
              mode: str, concurrency: int,
              partials: dict[int, dict] | None = None) -> dict[str, Any]:
    """Probe n prompts of the redo's population under the changed parameters; the report."""
    pool = population(r, k, mode)
    if not pool:
        raise UsageError(f"nothing to probe: no prompt would be redone ({mode})")
    # A beat's `url` is what its consumer calls (`server` names it across the cluster).
    servers = sorted({b.get("url") or b["server"] for b in heartbeats.read(r, k).values()
                      if b.get("server")})
    if not servers:
        raise UsageError("no live consumer: the probe runs on the servers the run's "
                         "consumers use; start `genq consume` first")
    sample = sorted(random.Random(0).sample(pool, min(n, len(pool))))
    data = open_dataset(info.dataset, info.dataset_version)
    data.verify(info.fingerprint)
    jobs = [(i, data.prompt(i // info.samples)) for i in sample]  # i: a task
    new = {**params.current(r, k)[1], **changes}
    answers, errors = asyncio.run(ask_all(servers, jobs, new, concurrency, partials))
    probed = sorted(answers)
    status = read_status(r, k.run)
    report = summarize(
        [(answers[i].completion_tokens, answers[i].finish_reason) for i in probed],
        old_tokens(r, k, probed), population=len(pool), remaining=status["remaining"],
        remaining_mean=status["output_tokens"]["mean"] or 0.0,
        tok_per_s=status["rate"]["tok_per_s"], servers=len(servers))
    return {**report, "changes": changes, "population_mode": mode, "errors": errors,
            "servers": servers}


def summarize(new: list[tuple[int, str | None]], old_tokens: list[int], *, population: int,
              remaining: int, remaining_mean: float, tok_per_s: float, servers: int,
              ) -> dict[str, Any]:
    """The report: truncation at the new limit (Wilson interval), the new lengths, and the whole
    redo's cost. new: (completion_tokens, finish_reason) per probed prompt; old_tokens: their
    current results'; population: prompts the redo runs; servers: GPUs sharing tok_per_s."""
    n = len(new)
    lengths = [t for t, _ in new]
    truncated = sum(1 for _, f in new if f == "length")
    low, high = wilson(truncated, n)
    pct = percentiles(Counter(lengths))  # nearest rank, as genq status reports them
    mean_new = fmean(lengths) if lengths else 0.0
    mean_old = fmean(old_tokens) if old_tokens else 0.0
    redo_tokens = population * mean_new
    left = remaining * remaining_mean + redo_tokens
    per_gpu = tok_per_s / servers if servers else 0.0
    return {
        "probe_n": n, "population": population, "truncated": truncated,
        "truncation_rate": round(truncated / n, 4) if n else None,
        "truncation_ci": [round(low, 4), round(high, 4)],
        "length_mean": round(mean_new, 1),
        "length_p50": pct["p50"], "length_p90": pct["p90"], "length_p99": pct["p99"],
        "old_length_mean": round(mean_old, 1),
        "extra_tokens": round(population * (mean_new - mean_old)),
        "redo_tokens": round(redo_tokens),
        "gpu_s": round(redo_tokens / per_gpu, 1) if per_gpu else None,
        "eta_s": round(left / tok_per_s, 1) if tok_per_s else None,
        "tok_per_s": round(tok_per_s, 1),
    }


def describe(rep: dict[str, Any]) -> str:
    """The report as a person reads it."""
    def dur(s: float | None) -> str:
        return "unknown (no output rate yet)" if s is None else f"{s / 3600:.1f} h ({s:,.0f} s)"
    lo, hi = rep["truncation_ci"]
    lines = [
        f"probe of {rep['probe_n']} of {rep['population']:,} prompts to redo "
        f"({rep['population_mode']}) under {rep['changes']}:",
        f"  truncated at the new limit: {rep['truncated']}/{rep['probe_n']} = "
        f"{rep['truncation_rate']:.1%} (95% CI {lo:.1%} - {hi:.1%})",
        f"  new length: mean {rep['length_mean']:,.0f}, p50 {rep['length_p50']:,}, "
        f"p90 {rep['length_p90']:,}, p99 {rep['length_p99']:,} "
        f"(their current results: mean {rep['old_length_mean']:,.0f})",
        f"  whole redo: {rep['redo_tokens']:,} tokens to generate, "
        f"{rep['extra_tokens']:+,} tokens in the data set, GPU time {dur(rep['gpu_s'])}",
        f"  ETA with the redo, at {rep['tok_per_s']:,.0f} tok/s: {dur(rep['eta_s'])}",
    ]
    lines += [f"  error: {e}" for e in rep["errors"][:5]]
    return "\n".join(lines)
