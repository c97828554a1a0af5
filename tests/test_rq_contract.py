"""RQ stays truthful: rq's own classes, `rq info` and rq-dashboard's JSON read a genq run
mid-run and after, with no glue; and what RQ's own tools do to a genq job (requeue, delete,
cancel, empty a queue; through rq's API, its CLI and rq-dashboard in a real browser) is what
genq then does."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import orjson
import pytest
from conftest import free_port, genq, wait_port
from pipeline import ConsumerProcess, failure_reason, read_jsonl, wait_for, write_dataset
from rq import Queue, Worker
from rq.job import Job
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry

from genq.common.queue.keys import RunKeys


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
        wait_for(lambda: r.zcard(k.leases) >= 6
                 and r.hget(k.rq_worker(_name(r, k)), "state") == b"busy",
                 what="six in flight and the consumer registered as busy")
        # Six in flight and the tasks claimed ahead for the next free slots: all started to RQ.
        # Read once the first six run (each ~3.5 s), so the tools below see these same leases.
        held = r.zcard(k.leases)
        assert 6 <= held <= 8
        started = StartedJobRegistry(queue=q)
        # `rq info` sweeps started registries with cleanup=True: live leases must survive it.
        info = subprocess.run(["rq", "info", "-u", redis_url, k.queue_name],
                              capture_output=True, text=True, timeout=30, env=dict(os.environ))
        assert info.returncode == 0, info.stderr
        assert f"{held} executing" in info.stdout and "1 workers" in info.stdout
        assert len(started.get_job_ids()) == held and r.zcard(k.leases) == held
        for job_id in started.get_job_ids():
            assert Job.fetch(job_id, connection=r).get_status().value == "started"
        [worker] = Worker.all(queue=q)
        assert worker.get_state() == "busy"
        assert worker.get_current_job_id().startswith(run_name)
        queues = dashboard.get("/rq-dashboard/0/data/queues.json").get_json()
        mine = next(x for x in queues["queues"] if x["name"] == k.queue_name)
        assert mine["started_job_registry_count"] == held
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


def _status(redis_url: str, run: str) -> dict:
    return orjson.loads(genq("status", "--json", redis_url=redis_url, run=run).stdout)


def _export(tmp_path, redis_url: str, run: str) -> list[dict]:
    out = tmp_path / f"{run}.export.jsonl"
    genq("export", "--out", str(out), redis_url=redis_url, run=run)
    return read_jsonl(out)


def _burst(redis_url, run, sim, out) -> None:
    c = ConsumerProcess(redis_url, run, sim.url, out, "--burst")
    try:
        assert c.wait(60) == 0, c.log()[-2000:]
    finally:
        c.cleanup()


@pytest.mark.timeout(180)
def test_rq_requeue_of_failed_jobs_runs_them_again(tmp_path, redis_url, r, run_name,
                                                   sim_factory):
    """FailedJobRegistry.requeue and `rq requeue --all` used to leave genq's failed bit set:
    the claim popped the job and dropped it, rq showed it queued forever."""
    n = 12
    data = write_dataset(tmp_path / "d.jsonl", n, poison=(2, 5, 8))
    strict = sim_factory(time_scale=1000)  # answers the poison prompts with HTTP 400
    lenient = sim_factory(time_scale=1000, bad_marker="__nothing_matches__")
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    _burst(redis_url, run_name, strict, tmp_path / "o")
    k = RunKeys(run_name)
    q = Queue(k.queue_name, connection=r)
    failed = FailedJobRegistry(queue=q)
    assert sorted(failed.get_job_ids()) == [f"{run_name}-{i}" for i in (2, 5, 8)]
    failed.requeue(f"{run_name}-2")
    cli = subprocess.run(["rq", "requeue", "-u", redis_url, "--queue", k.queue_name, "--all"],
                         capture_output=True, text=True, timeout=30, env=dict(os.environ))
    assert cli.returncode == 0, cli.stderr
    assert len(q) == 3 and failed.count == 0
    _burst(redis_url, run_name, lenient, tmp_path / "o")
    records = _export(tmp_path, redis_url, run_name)
    assert sorted(rec["index"] for rec in records) == list(range(n))
    st = _status(redis_url, run_name)
    assert (st["done"], st["failed"], st["queued"]) == (n, 0, 0)
    assert not r.hlen(k.errors) and len(q) == 0 and failed.count == 0


@pytest.mark.timeout(180)
def test_rq_delete_cancel_and_empty_settle_as_failed_with_the_reason(
        tmp_path, redis_url, r, run_name, sim_factory):
    """Job.delete (rq-dashboard's Delete), Job.cancel and Queue.empty (its Empty) used to leave
    genq's pending bit set with no job: nothing ran it and `--burst` never finished."""
    n = 10
    sim = sim_factory(time_scale=1000)
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", n)), "--once",
         redis_url=redis_url, run=run_name)
    Job.fetch(f"{run_name}-2", connection=r).delete()
    Job.fetch(f"{run_name}-5", connection=r).cancel()
    emptied = run_name + "e"
    genq("produce", str(write_dataset(tmp_path / "e.jsonl", 4)), "--once",
         redis_url=redis_url, run=emptied)
    assert Queue(RunKeys(emptied).queue_name, connection=r).empty() == 4
    _burst(redis_url, run_name, sim, tmp_path / "o")
    _burst(redis_url, emptied, sim, tmp_path / "oe")
    k = RunKeys(run_name)
    st = _status(redis_url, run_name)
    assert (st["done"], st["failed"], st["queued"], st["inflight"]) == (n - 2, 2, 0, 0)
    assert failure_reason(r, k, 2).startswith("job deleted through RQ")
    assert failure_reason(r, k, 5).startswith("job canceled through RQ")
    assert _status(redis_url, emptied)["failed"] == 4
    redo_hint = "through RQ; `genq requeue --redo failed` runs it again"
    assert sorted((x["reason"], x["count"]) for x in st["failure_reasons"]) == [
        (f"job canceled {redo_hint}", 1), (f"job deleted {redo_hint}", 1)]
    # One record per prompt when asked: the failed ones carry their reason.
    out = tmp_path / "with-failed.jsonl"
    genq("export", "--out", str(out), "--include-failed", redis_url=redis_url, run=run_name)
    failed = [rec for rec in read_jsonl(out) if rec.get("status") == "failed"]
    assert len(read_jsonl(out)) == n and [rec["index"] for rec in failed] == [2, 5]
    # Nothing is lost: a redo runs them, and the export has every prompt once.
    genq("requeue", "--redo", "failed", redis_url=redis_url, run=run_name)
    _burst(redis_url, run_name, sim, tmp_path / "o")
    assert sorted(rec["index"] for rec in _export(tmp_path, redis_url, run_name)) == \
        list(range(n))


@pytest.mark.timeout(120)
def test_rq_requeue_of_a_finished_job_is_refused_visibly(tmp_path, redis_url, r, run_name,
                                                         sim_factory):
    """A finished job requeued through rq (FinishedJobRegistry.requeue) is not run twice: it
    shows as finished again, and `genq requeue --redo` is the way to run a prompt again."""
    sim = sim_factory(time_scale=1000)
    genq("produce", str(write_dataset(tmp_path / "d.jsonl", 3)), "--once",
         redis_url=redis_url, run=run_name)
    _burst(redis_url, run_name, sim, tmp_path / "o")
    q = Queue(RunKeys(run_name).queue_name, connection=r)
    FinishedJobRegistry(queue=q).requeue(f"{run_name}-1")
    assert len(q) == 1
    _burst(redis_url, run_name, sim, tmp_path / "o")
    assert len(q) == 0
    assert Job.fetch(f"{run_name}-1", connection=r).get_status().value == "finished"
    assert f"{run_name}-1" in FinishedJobRegistry(queue=q).get_job_ids()
    lines = [rec for p in (tmp_path / "o").glob("*.jsonl") for rec in read_jsonl(p)]
    assert sorted(rec["index"] for rec in lines) == [0, 1, 2]  # ran once each


@contextlib.contextmanager
def dashboard_server(redis_url: str, log_path):
    """rq-dashboard as users run it: its own CLI, a real HTTP server on a free port."""
    port = free_port()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rq_dashboard", "-b", "127.0.0.1", "-p", str(port),
             "-u", redis_url, "--poll-interval", "300"],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        wait_port(port, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(180)
def test_dashboard_workers_tab_and_requeue_button_in_a_browser(tmp_path, redis_url, r, run_name,
                                                               sim_factory):
    from playwright.sync_api import sync_playwright

    n = 6
    data = write_dataset(tmp_path / "d.jsonl", n, poison=(3,))
    strict = sim_factory(time_scale=1000)
    lenient = sim_factory(time_scale=1000, bad_marker="__nothing_matches__")
    genq("produce", str(data), "--once", redis_url=redis_url, run=run_name)
    _burst(redis_url, run_name, strict, tmp_path / "o")
    k = RunKeys(run_name)
    assert r.getbit(k.failed, 3) == 1
    # A consumer with nothing to do: idle in rq's eyes.
    c = ConsumerProcess(redis_url, run_name, lenient.url, tmp_path / "o")
    try:
        wait_for(lambda: r.hget(k.rq_worker(_name(r, k)), "state") == b"idle",
                 what="an idle consumer registered with rq")
        with dashboard_server(redis_url, tmp_path / "dash.log") as url, sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium",
                                        args=["--no-sandbox"])
            with contextlib.closing(browser):
                page = browser.new_page()
                with page.expect_response(lambda x: "workers.json" in x.url) as answer:
                    page.goto(url + "/0/view/workers")
                assert answer.value.status == 200  # was 500 while any consumer was idle
                page.wait_for_selector(f"text={_name(r, k)}")
                page.goto(url + f"/0/view/job/{run_name}-3")
                page.click("#requeue-job-btn")
                # genq follows: the consumer runs the requeued prompt.
                wait_for(lambda: r.getbit(k.done, 3) == 1, timeout=30,
                         what="the requeued prompt done")
        c.signal(signal.SIGTERM)
        assert c.wait(60) == 0, c.log()[-2000:]
    finally:
        c.cleanup()
    assert sorted(rec["index"] for rec in _export(tmp_path, redis_url, run_name)) == \
        list(range(n))
    assert _status(redis_url, run_name)["failed"] == 0
