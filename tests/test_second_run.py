"""A new run of the same name in the output directory of an earlier one, as `docker compose down
-v` then `up -d` makes it: Redis starts empty, the producer registers a fresh run, and the
consumers, pointed at the same /out, write the new run beside the earlier run's output, which
stays as it was."""

from __future__ import annotations

import pytest
from conftest import genq
from faultkit import private_redis
from pipeline import read_jsonl, write_dataset

from genq.common.queue.keys import RunKeys

N = 6


@pytest.mark.timeout(180)
def test_a_fresh_run_in_an_earlier_runs_output_directory_is_written_beside_it(
        tmp_path, run_name, sim_factory):
    data = write_dataset(tmp_path / "d.jsonl", N)
    sim = sim_factory(time_scale=50, length_dist="fixed:20", max_running_requests=4)
    out, k = tmp_path / "out", RunKeys(run_name)

    def one_run(url: str) -> list[int]:
        """The README's commands: produce, consume to the end, export."""
        genq("produce", str(data), "--once", redis_url=url, run=run_name)
        consume = genq("consume", "--server", sim.url, "--out", str(out), "--burst",
                       redis_url=url, run=run_name, check=False, timeout=120)
        assert consume.returncode == 0, consume.stderr[-2000:]
        export = tmp_path / "results.jsonl"
        genq("export", "--out", str(export), redis_url=url, run=run_name)
        return [rec["index"] for rec in read_jsonl(export)]

    with private_redis() as srv:
        r = srv.client()
        assert one_run(srv.url) == list(range(N))
        earlier = {p.name: p.read_bytes() for p in out.iterdir()}
        r.flushall()  # `down -v`: the Redis volume is gone, the host's output directory stays
        assert one_run(srv.url) == list(range(N))
        epoch = r.hget(k.meta, "epoch").decode()
        r.close()
    # The earlier run's files are untouched; the new run's are in a directory named by its epoch.
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == earlier
    mine = out / f"{run_name}-{epoch}"
    assert (mine / f"{run_name}.manifest.json").exists()
    assert sum(len(read_jsonl(p)) for p in mine.glob(f"{run_name}.*.jsonl")) == N
