"""`genq requeue --redo truncated --continue` on the simulator and real Redis: each truncated
answer goes on from its partial, and the run ends exactly where regenerating would, for fewer
decode tokens."""

from __future__ import annotations

from collections import Counter

import httpx
import orjson
import pytest
from conftest import genq
from faultkit import record_figures
from pipeline import ConsumerProcess, read_jsonl, wait_for, write_dataset
from sglang_servers import start_server

from genq.common.queue.keys import RunKeys


def run_to_end(redis_url, run, sim, out) -> None:
    c = ConsumerProcess(redis_url, run, sim.url, out, "--burst")
    assert c.wait(120) == 0
    c.cleanup()


def export(tmp_path, redis_url, run) -> dict[int, dict]:
    out = tmp_path / f"{run}.jsonl"
    genq("export", "--out", str(out), redis_url=redis_url, run=run)
    return {rec["index"]: rec for rec in read_jsonl(out)}


def decoded(sim) -> int:
    return httpx.get(sim.url + "/_sim/stats", timeout=5).json()["output_tokens"]


@pytest.mark.timeout(300)
def test_continue_ends_where_regenerating_would(tmp_path, redis_url, r, run_name, sim_factory):
    n = 200
    data = write_dataset(tmp_path / "d.jsonl", n)
    runs = {"cont": run_name, "again": run_name + "-again"}
    sims = {way: sim_factory(time_scale=1000, reasoning_parser="qwen3",
                             length_dist="lognormal:300:0.8") for way in runs}
    for way, run in runs.items():
        genq("produce", str(data), "--once", "--max-tokens", "400", redis_url=redis_url, run=run)
        run_to_end(redis_url, run, sims[way], tmp_path / way)
    first = export(tmp_path, redis_url, runs["cont"])
    truncated = {i for i, rec in first.items() if rec["finish_reason"] == "length"}
    assert 20 < len(truncated) < n  # some stopped inside the thinking, some in the answer
    assert any(first[i]["content"] for i in truncated)
    assert any(not first[i]["content"] for i in truncated)

    dry = genq("requeue", "--set", "max_tokens=1200", "--redo", "truncated", "--continue",
               "--dry-run", redis_url=redis_url, run=runs["cont"]).stdout
    assert f"continue: {len(truncated)} truncated answers" in dry
    assert r.exists(RunKeys(runs["cont"]).partials) == 0  # a dry run keeps nothing
    before = {way: decoded(sim) for way, sim in sims.items()}
    out = genq("requeue", "--set", "max_tokens=1200", "--redo", "truncated", "--continue",
               redis_url=redis_url, run=runs["cont"]).stdout
    assert f"partials kept for --continue: {len(truncated)}" in out
    genq("requeue", "--set", "max_tokens=1200", "--redo", "truncated",
         redis_url=redis_url, run=runs["again"])
    for way, run in runs.items():
        run_to_end(redis_url, run, sims[way], tmp_path / way)
    redo = {way: decoded(sim) - before[way] for way, sim in sims.items()}

    cont, again = export(tmp_path, redis_url, runs["cont"]), export(tmp_path, redis_url,
                                                                      runs["again"])
    for i in truncated:
        old, new = first[i], cont[i]
        assert new["continued_from"] == {"version": 1, "attempt": old["attempt"],
                                         "tokens": old["completion_tokens"]}
        assert new["reasoning_content"].startswith(old["reasoning_content"])
        assert new["content"].startswith(old["content"])
        # The whole answer is the one the prompt gets straight at the larger limit.
        assert (new["reasoning_content"], new["content"], new["completion_tokens"],
                new["finish_reason"]) == (again[i]["reasoning_content"], again[i]["content"],
                                          again[i]["completion_tokens"],
                                          again[i]["finish_reason"])
    assert Counter(rec["completion_tokens"] for rec in cont.values()) == Counter(
        rec["completion_tokens"] for rec in again.values())
    prefix = sum(first[i]["completion_tokens"] for i in truncated)
    record_figures("continue_sim", truncated=len(truncated), redo_decoded_continue=redo["cont"],
                   redo_decoded_regenerate=redo["again"], prefix_tokens=prefix,
                   lengths_p50_p90_max=[sorted(x["completion_tokens"] for x in cont.values())[
                       int(q * (n - 1))] for q in (0.5, 0.9, 1.0)])
    assert redo["cont"] == redo["again"] - prefix
    assert r.exists(RunKeys(runs["cont"]).partials) == 0  # each deleted by its accepted ack
    st = orjson.loads(genq("status", "--json", redis_url=redis_url, run=runs["cont"]).stdout)
    assert st["continued"] == {"2": {"continued": len(truncated), "decode_tokens_saved": prefix}}


def test_continue_needs_redo_truncated(redis_url, run_name):
    out = genq("requeue", "--set", "max_tokens=10", "--continue", redis_url=redis_url,
               run=run_name, check=False)
    assert out.returncode != 0 and "give --redo truncated" in out.stderr


@pytest.mark.real_sglang
def test_continue_on_real_sglang(tmp_path, redis_url, r, run_name):
    """Greedy decoding on the real server (thinking on, --reasoning-parser qwen3). The tiny
    random model's greedy answers end after a token or two, so ignore_eos keeps them going:
    every answer is cut at max_tokens, and its continuation too."""

    server = start_server("real", "tuned")
    try:
        n, small, large = 24, 40, 100
        data = write_dataset(tmp_path / "d.jsonl", n)
        runs = {"cont": run_name, "straight": run_name + "-straight"}
        for run, limit in ((runs["cont"], small), (runs["straight"], large)):
            genq("produce", str(data), "--once", "--max-tokens", str(limit), "--temperature",
                 "0", "--raw", "ignore_eos=true", redis_url=redis_url, run=run)
            run_to_end(redis_url, run, server, tmp_path / run)
        first = export(tmp_path, redis_url, runs["cont"])
        assert all(rec["finish_reason"] == "length" for rec in first.values())
        _, generated_before = server.token_counters()
        out = genq("requeue", "--set", f"max_tokens={large}", "--redo", "truncated",
                   "--continue", redis_url=redis_url, run=runs["cont"]).stdout
        assert f"partials kept for --continue: {n}" in out
        run_to_end(redis_url, runs["cont"], server, tmp_path / runs["cont"])
        _, generated_after = server.token_counters()
        cont, straight = (export(tmp_path, redis_url, run) for run in runs.values())
    finally:
        server.close()
    for i, old in first.items():
        new = cont[i]
        assert new["continued_from"]["tokens"] == old["completion_tokens"] == small
        assert new["reasoning_content"].startswith(old["reasoning_content"])
        assert new["content"].startswith(old["content"])
        assert new["completion_tokens"] == large  # the partial's 40 and the new 60
    grown = generated_after - generated_before
    regenerating = n * large
    same = sum((cont[i]["reasoning_content"], cont[i]["content"]) ==
               (straight[i]["reasoning_content"], straight[i]["content"]) for i in first)
    record_figures("continue_real", answers=n, generated=grown, regenerating=regenerating,
                   ratio=round(grown / regenerating, 3), equal_to_straight=same)
    assert grown == n * (large - small) <= 0.8 * regenerating


@pytest.mark.timeout(300)
def test_a_probe_that_continues_decodes_only_the_new_part(tmp_path, redis_url, r, run_name,
                                                          sim_factory):
    from test_probe import FLAGS, settled

    sim = sim_factory(time_scale=1000, reasoning_parser="qwen3", length_dist="lognormal:300:0.8")
    n, k = 120, RunKeys(run_name)
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", n)), "--once", "--max-tokens", "400",
         redis_url=redis_url, run=run_name)
    consumer = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "out", *FLAGS)
    try:
        wait_for(lambda: settled(r, k, n), timeout=120, what="the first pass")
        args = ("--set", "max_tokens=1200", "--redo", "truncated", "--continue")
        before = decoded(sim)
        rep = orjson.loads(genq("requeue", "--probe", "8", *args, "--json",
                                redis_url=redis_url, run=run_name).stdout)
        assert rep["probe_n"] == 8 and not rep["errors"]
        # Each probed answer decoded only what it adds to its partial of 400 tokens.
        probed = round(rep["length_mean"] * 8) - 8 * 400
        assert decoded(sim) - before == probed
        genq("requeue", *args, redis_url=redis_url, run=run_name)
        wait_for(lambda: settled(r, k, n) and not r.exists(k.partials), timeout=120,
                 what="the redo")
        records = export(tmp_path, redis_url, run_name)
        assert all(rec["continued_from"]["tokens"] == 400 for rec in records.values()
                   if rec["params_version"] == 2)
    finally:
        consumer.cleanup()
