"""`genq export` says what it writes: a record that is not the accepted result is counted and
reported, the claim counter (the record's `attempt`) never saturates, and --include-failed
writes one record per failed prompt with its reason."""

from __future__ import annotations

import orjson
from conftest import genq
from pipeline import ConsumerProcess, read_jsonl, write_dataset
from test_scripts import ack, claim, setup_run

from genq.common.queue import scripts
from genq.common.store import export


def shard(tmp_path, run: str, records: list[dict]):
    out = tmp_path / "shards"
    out.mkdir(exist_ok=True)
    with open(out / f"{run}.test.jsonl", "ab") as f:
        for rec in records:
            f.write(orjson.dumps({"run": run, "content": "x", **rec}) + b"\n")
    return out


def line(index: int, attempt: int, content: str = "x") -> dict:
    return {"index": index, "params_version": 1, "attempt": attempt, "content": content}


def test_claim_counter_counts_past_255(r, run_name):
    """A u8 counter stuck at 255: a zombie's line and the holder's shared an attempt number."""
    k, runner = setup_run(r, run_name, 1)
    for n in range(1, 301):
        [(jid, idx, ex, attempt)] = claim(runner, k)
        assert attempt == n
        assert runner(scripts.release_call(k, jid, idx, ex, refund=True)) == 1
    final = claim(runner, k)[0]
    assert final[3] == 301 and ack(runner, k, final) == 1
    accepted, _, _ = export.accepted_state(r, k)
    assert accepted(0) == (1, 301)


def test_export_reports_a_record_that_is_not_the_accepted_one(tmp_path, redis_url, r,
                                                               run_name):
    k, runner = setup_run(r, run_name, 3)
    leases = claim(runner, k, n=3)
    # Index 1's first lease expires and is reaped; the second claim's result is accepted.
    r.zadd(k.leases, {leases[1][0]: 0}, xx=True)
    runner(scripts.reap_call(k))
    second = claim(runner, k)[0]
    for lease in (leases[0], second, leases[2]):
        assert ack(runner, k, lease) == 1
    # The accepted line of index 1 (attempt 2) was lost from the shards; the zombie's is there.
    out_dir = shard(tmp_path, run_name, [line(0, 1), line(1, 1, "zombie"), line(2, 1)])
    r.sadd(k.outdirs, str(out_dir))
    out = tmp_path / "export.jsonl"
    proc = genq("export", "--out", str(out), redis_url=redis_url, run=run_name, check=False)
    assert proc.returncode == 1
    assert "1 records are not the accepted result" in proc.stderr and "[1]" in proc.stderr
    assert [rec["index"] for rec in read_jsonl(out)] == [0, 1, 2]
    result = export.export(r, k, 3, [str(out_dir)], str(tmp_path / "again.jsonl"))
    assert (result.not_accepted, result.not_accepted_count) == ([1], 1)
    # With the accepted line back, the export is clean and picks it over the zombie's.
    shard(tmp_path, run_name, [line(1, 2, "accepted")])
    proc = genq("export", "--out", str(out), redis_url=redis_url, run=run_name)
    assert proc.returncode == 0 and "warning" not in proc.stderr
    assert [rec["content"] for rec in read_jsonl(out)] == ["x", "accepted", "x"]


def test_export_include_failed_writes_each_failed_prompt_with_its_reason(
        tmp_path, redis_url, r, run_name):
    k, runner = setup_run(r, run_name, 4)
    leases = claim(runner, k, n=4)
    for lease in (leases[0], leases[2]):
        assert ack(runner, k, lease) == 1
    for lease, reason in ((leases[1], "row 1: not valid JSON"), (leases[3], "HTTP 400: <b>")):
        jid, idx, ex, _ = lease
        assert runner(scripts.fail_call(k, jid, idx, ex, reason=reason, worker="w")) == 1
    r.sadd(k.outdirs, str(shard(tmp_path, run_name, [line(0, 1), line(2, 1)])))
    out = tmp_path / "export.jsonl"
    plain = genq("export", "--out", str(out), redis_url=redis_url, run=run_name)
    assert [rec["index"] for rec in read_jsonl(out)] == [0, 2]
    assert "exported 2 records (2 done of 4)" in plain.stdout
    proc = genq("export", "--out", str(out), "--include-failed", redis_url=redis_url,
                run=run_name)
    assert "exported 2 records and 2 failed" in proc.stdout
    records = read_jsonl(out)
    assert [rec["index"] for rec in records] == [0, 1, 2, 3]  # one record per prompt
    assert records[1] == {"index": 1, "run": run_name, "status": "failed",
                          "error": "row N: not valid JSON",  # kept once for all its rows
                          "error_kind": "row N: not valid JSON"}
    assert records[3]["error"] == "HTTP 400: <b>" and "status" not in records[0]


def test_export_out_makes_its_directory_and_takes_the_format_from_the_suffix(
        tmp_path, redis_url, r, run_name):
    k, runner = setup_run(r, run_name, 2)
    for lease in claim(runner, k, n=2):
        assert ack(runner, k, lease) == 1
    r.sadd(k.outdirs, str(shard(tmp_path, run_name, [line(0, 1), line(1, 1)])))
    # A directory that does not exist yet is made, as the consumer makes its --out.
    nested = tmp_path / "new" / "dir" / "results.jsonl"
    proc = genq("export", "--out", str(nested), redis_url=redis_url, run=run_name, check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert [rec["index"] for rec in read_jsonl(nested)] == [0, 1]
    # `.parquet` without --format: Parquet, not JSONL under a Parquet name.
    parquet = tmp_path / "results.parquet"
    genq("export", "--out", str(parquet), redis_url=redis_url, run=run_name)
    assert parquet.read_bytes()[:4] == b"PAR1"
    # An explicit --format the suffix contradicts: one clear line, nothing written.
    proc = genq("export", "--out", str(tmp_path / "x.parquet"), "--format", "jsonl",
                redis_url=redis_url, run=run_name, check=False)
    assert proc.returncode == 2 and not (tmp_path / "x.parquet").exists()
    assert proc.stderr.count("\n") == 1 and "--format jsonl" in proc.stderr, proc.stderr


def test_export_never_replaces_an_earlier_runs_file_unasked(tmp_path, redis_url, r, run_name):
    """README's compose block twice: `down -v` forgets the run, `up` registers it anew under the
    same name, and its export to the same --out keeps the first run's results beside it."""
    def exported_run(content: str) -> None:
        k, runner = setup_run(r, run_name, 2)
        for lease in claim(runner, k, n=2):
            assert ack(runner, k, lease) == 1
        r.sadd(k.outdirs, str(shard(tmp_path / content, run_name,
                                    [line(0, 1, content), line(1, 1, content)])))

    for name in ("first", "second", "third"):
        (tmp_path / name).mkdir()
    out = tmp_path / "results.jsonl"
    exported_run("first")
    genq("export", "--out", str(out), redis_url=redis_url, run=run_name)
    # The same run exports again to its own file (after a requeue, say): replaced, none kept.
    genq("export", "--out", str(out), redis_url=redis_url, run=run_name)
    assert sorted(p.name for p in tmp_path.glob("results*")) == ["results.jsonl"]
    first = out.read_bytes()
    r.delete(*r.keys(f"genq:{run_name}:*"))  # `down -v`: the run is forgotten
    exported_run("second")
    proc = genq("export", "--out", str(out), redis_url=redis_url, run=run_name)
    [kept] = [p for p in tmp_path.glob("results*") if p != out]
    assert kept.read_bytes() == first and str(kept) in proc.stdout, proc.stdout
    assert [rec["content"] for rec in read_jsonl(out)] == ["second", "second"]
    # --overwrite: replaced whatever wrote it, nothing more kept.
    r.delete(*r.keys(f"genq:{run_name}:*"))
    exported_run("third")
    genq("export", "--out", str(out), "--overwrite", redis_url=redis_url, run=run_name)
    assert [rec["content"] for rec in read_jsonl(out)] == ["third", "third"]
    assert sorted(tmp_path.glob("results*")) == sorted([out, kept])


def test_a_failed_line_has_one_shape_whoever_wrote_it(tmp_path, redis_url, run_name,
                                                      sim_factory):
    """The consumer's failed line (copied from its shard) and the one export makes from Redis
    where no shard has it: the same keys in the same order, the consumer's adding what only it
    knew; Redis keeps the reason's kind, so that line's `error` is the kind."""
    data = write_dataset(tmp_path / "d.jsonl", 6, poison=(1, 4))
    genq("produce", str(data), "--once", "--samples", "2", redis_url=redis_url, run=run_name)
    consumer = ConsumerProcess(redis_url, run_name, sim_factory(time_scale=1000).url,
                               tmp_path / "out", "--burst")
    assert consumer.wait(60) == 0, consumer.log()[-2000:]
    consumer.cleanup()
    (tmp_path / "none").mkdir()
    lines = {}
    for how, extra in (("shard", []), ("redis", ["--shards", str(tmp_path / "none")])):
        out = tmp_path / f"{how}.jsonl"
        genq("export", "--out", str(out), "--include-failed", *extra, redis_url=redis_url,
             run=run_name, check=False)
        lines[how] = [rec for rec in read_jsonl(out) if rec.get("status") == "failed"]
    assert len(lines["shard"]) == len(lines["redis"]) == 4
    for full, bare in zip(lines["shard"], lines["redis"], strict=True):
        assert full["id"] in ("p1", "p4") and full["server"] and full["attempt"] >= 1
        assert list(bare) == [key for key in full if key in bare]
        assert bare == {**{key: full[key] for key in bare}, "error": full["error_kind"]}
        assert set(bare) == {"index", "sample", "run", "status", "error", "error_kind"}
