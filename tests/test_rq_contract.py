"""RQ stays truthful: rq's own classes, `rq info` and rq-dashboard's JSON read a genq run
mid-run and after, with no glue."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import genq
from pipeline import ConsumerProcess, wait_for, write_dataset
from rq import Queue, Worker
from rq.job import Job
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry

from common.keys import RunKeys


@pytest.fixture
def dashboard(redis_url, monkeypatch):
    monkeypatch.setenv("RQ_DASHBOARD_REDIS_URL", redis_url)
    from rq_dashboard.app import create_app

    app = create_app()
    return app.test_client()


@pytest.mark.timeout(120)
def test_rq_tools_see_the_run_mid_run_and_after(tmp_path, redis_url, r, run_name,
                                                sim_factory, dashboard):
    n = 24
    data = write_dataset(tmp_path / "d.jsonl", n, no_fields=(5,))
    # About 3.5 s a request: the first six stay in flight, unchanged, while the tools look
    # (they are claimed together, and the looking takes a second or two).
    sim = sim_factory(time_scale=10, max_running_requests=6, length_dist="fixed:3000")
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    k = RunKeys(run_name)
    q = Queue(k.queue_name, connection=r)
    c = ConsumerProcess(redis_url, run_name, sim.url, tmp_path / "o", "--burst")
    try:
        wait_for(lambda: r.zcard(k.leases) == 6
                 and r.hget(k.rq_worker(_name(r, k)), "state") == b"busy",
                 what="6 in flight and the consumer registered as busy")
        started = StartedJobRegistry(queue=q)
        # `rq info` sweeps started registries with cleanup=True: live leases must survive it.
        info = subprocess.run(["rq", "info", "-u", redis_url, k.queue_name],
                              capture_output=True, text=True, timeout=30, env=dict(os.environ))
        assert info.returncode == 0, info.stderr
        assert "6 executing" in info.stdout and "1 workers" in info.stdout
        assert len(started.get_job_ids()) == 6 and r.zcard(k.leases) == 6
        for job_id in started.get_job_ids():
            assert Job.fetch(job_id, connection=r).get_status().value == "started"
        [worker] = Worker.all(queue=q)
        assert worker.get_state() == "busy"
        assert worker.get_current_job_id().startswith(run_name)
        queues = dashboard.get("/rq-dashboard/0/data/queues.json").get_json()
        mine = next(x for x in queues["queues"] if x["name"] == k.queue_name)
        assert mine["started_job_registry_count"] == 6
        assert mine["count"] == len(q)
        workers = dashboard.get("/rq-dashboard/0/data/workers.json").get_json()["workers"]
        assert [w["queues"] for w in workers if k.queue_name in w["queues"]]
        assert c.wait(120) == 0, c.log()[-2000:]
    finally:
        c.cleanup()
    assert len(q) == 0 and StartedJobRegistry(queue=q).count == 0
    assert FinishedJobRegistry(queue=q).count == n - 1
    assert FailedJobRegistry(queue=q).get_job_ids() == [f"{run_name}-5"]
    job = dashboard.get(f"/rq-dashboard/0/data/job/{run_name}-5.json").get_json()
    assert job["status"] == "failed" and "neither 'messages' nor 'prompt'" in job["exc_info"]
    assert Worker.all(queue=q) == []  # the consumer unregistered on exit


def _name(r, k: RunKeys) -> str:
    names = r.zrange(k.consumers, 0, -1)
    return names[0].decode() if names else "none"
