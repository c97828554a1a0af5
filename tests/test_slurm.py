"""genq on a real Slurm (`bash .ci/slurm-test.sh` brings one up and runs this alone): the steps
of docs/SLURM.md with the simulator as the server command. A 3-task array, two servers a task,
each task with its own output directory; nothing shared but Redis and S3 (moto), the data set in
S3 alone. One task is preempted (`scontrol requeue`) and one cancelled and resubmitted; the run
completes and the export from S3 is exact."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import boto3
import httpx
import orjson
import pytest
from conftest import REPO, free_port, genq
from moto.server import ThreadedMotoServer
from pipeline import read_jsonl, wait_for, write_dataset

from genq.common.queue.keys import RunKeys

pytestmark = pytest.mark.slurm
BUCKET = "genq-slurm"
SBATCH = str(REPO / "scripts" / "slurm" / "genq.sbatch")


def slurm(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip()


def job_field(job: str, field: str) -> str | None:
    """A field of `scontrol show job` (None once Slurm forgot the job)."""
    proc = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True)
    match = re.search(rf"\b{field}=(\S+)", proc.stdout)
    return match.group(1) if match else None


def active(*jobs: str) -> list[str]:
    ids = ",".join(jobs)
    return slurm("squeue", "-h", "-j", ids, "-o", "%i %T").splitlines()


@pytest.fixture
def cluster(tmp_path, redis_url, run_name, monkeypatch):
    """moto's S3, the data set in it alone, the run produced from it, and the environment every
    `sbatch` passes on (docs/SLURM.md's step 1)."""
    if not os.environ.get("SLURM_CONF") or subprocess.run(["sinfo"]).returncode:
        pytest.fail("no Slurm to submit to: run `bash .ci/slurm-test.sh`")
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    moto.start()
    endpoint = f"http://127.0.0.1:{moto._port}"
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
        "REDIS_URL": redis_url, "GENQ_RUN": run_name, "GENQ_S3_URI": f"s3://{BUCKET}/runs",
        "GENQ_SERVER_CMD": f"{sys.executable} -m genq sim --port {{port}} --time-scale 10 "
                           "--max-running-requests 8",
        "GENQ_GPUS": "0,1", "GENQ_OUT": str(tmp_path / "nodes"), "GENQ_GRACE": "10",
        "GENQ": f"{sys.executable} -m genq", "PYTHONPATH": str(REPO),
        "GENQ_MONITOR_PORT": str(free_port()),
        "XDG_CACHE_HOME": str(tmp_path / "login-node"),  # the producer's copy of the data set
    }.items():
        monkeypatch.setenv(key, value)
    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket=BUCKET)
    data = write_dataset(tmp_path / "prompts.jsonl", 1200)
    s3.upload_file(str(data), BUCKET, "data/prompts.jsonl")
    data.unlink()
    genq("produce", f"s3://{BUCKET}/data/prompts.jsonl", "--once", redis_url=redis_url,
         run=run_name)
    yield 1200
    moto.stop()


def test_an_array_survives_preemption_and_cancel_and_exports_exactly(
        cluster, tmp_path, redis_url, r, run_name):
    n, done = cluster, RunKeys(run_name).done
    logs = tmp_path / "logs"
    logs.mkdir()
    submit = ["sbatch", "--parsable", f"--output={logs}/%A_%a.log"]
    started = time.monotonic()
    job = slurm(*submit, "--array=0-2", SBATCH)
    monitor = slurm(*submit[:2], f"--output={logs}/monitor.log",
                    str(REPO / "scripts" / "slurm" / "genq-monitor.sbatch"))
    jobs = [job, monitor]
    try:
        wait_for(lambda: r.bitcount(done), 180, 0.1, what="the first result")
        first_result_s = time.monotonic() - started
        wait_for(lambda: r.bitcount(done) >= n // 5, 300, 0.2, what="a fifth done")
        slurm("scontrol", "requeue", f"{job}_1")  # as a preemption: SIGTERM, then requeued
        requeued = time.monotonic()
        slurm("scancel", f"{job}_2")  # mid-run: its consumers hold work when the signal comes
        wait_for(lambda: not [j for j in active(job) if j.startswith(f"{job}_2 ")], 120, 0.2,
                 what="the cancelled task gone")
        drained(logs / f"{job}_2.log", r, RunKeys(run_name))
        # Slurm holds a requeued job 120 s (Reason=BeginTime); when it runs again is the
        # cluster's choice, genq's part is the same either way: released at once.
        held = wait_for(lambda: job_field(f"{job}_1", "Reason") == "BeginTime" or (
            job_field(f"{job}_1", "Restarts") == "1" and "running"), 200, 0.2,
            what="the requeued task held or running")
        if held is True:
            slurm("scontrol", "update", f"JobId={job}_1", "StartTime=now")
        wait_for(lambda: job_field(f"{job}_1", "Restarts") == "1"
                 and job_field(f"{job}_1", "JobState") == "RUNNING", 400, 0.2,
                 what="the requeued task running again")
        back_s = time.monotonic() - requeued
        jobs.append(slurm(*submit, "--array=2", SBATCH))  # resubmitted: a new job, same run
        port = os.environ["GENQ_MONITOR_PORT"]
        status = wait_for(lambda: monitor_status(port), 60, 0.5, what="the monitor")
        assert status["total"] == n
        wait_for(lambda: not active(job, jobs[2]), 600, 1, what="every task finished")
    finally:
        subprocess.run(["scancel", *jobs])
    print(f"\nsbatch to first result {first_result_s:.1f} s; requeue to running {back_s:.1f} s")
    assert r.bitcount(done) == n
    task1 = (logs / f"{job}_1.log").read_text()
    assert task1.count('"consumer_started"') == 4, task1[-3000:]  # 2 servers, started twice
    remote, local = tmp_path / "remote.jsonl", tmp_path / "local.jsonl"
    genq("export", "--from-s3", os.environ["GENQ_S3_URI"], "--out", str(remote),
         redis_url=redis_url, run=run_name)
    genq("export", "--out", str(local), redis_url=redis_url, run=run_name)  # same machine here
    assert [rec["index"] for rec in read_jsonl(remote)] == list(range(n))
    assert remote.read_bytes() == local.read_bytes()


def drained(log_path, r, k: RunKeys) -> None:
    """A task cancelled mid-run drained on Slurm's one SIGTERM: each consumer stopped on the
    signal (not at the run's end), was not told twice (which gives everything in flight back
    at once), shipped every shard within its grace and exited 0, and holds no lease."""
    log = log_path.read_text()
    events = [orjson.loads(line) for line in log.splitlines() if line.startswith("{")]
    names = [e.get("event") for e in events]
    assert names.count("stopping") == 2 and "run_settled" not in names, log[-3000:]
    assert not [e for e in events if e.get("then") == "giving it all back now"], log[-3000:]
    assert names.count("consumer_stopped") == 2, log[-3000:]
    assert names.count("all_shipped") == 2, log[-3000:]
    assert "genq.sbatch: consumers exited 0 0" in log, log[-3000:]
    servers = {e["server"] for e in events if e.get("server")}
    owners = {v.decode().split("|")[1] for v in r.hvals(k.lease_owner)}
    assert len(servers) == 2 and not servers & owners


def test_a_server_that_dies_while_starting_ends_the_task_in_seconds(cluster, tmp_path,
                                                                    monkeypatch):
    """The server command exits at once (a bad model path, say): the task says so and ends,
    instead of holding its GPUs for GENQ_SERVER_WAIT (30 minutes)."""
    monkeypatch.setenv("GENQ_SERVER_CMD", f"{sys.executable} -c 'raise SystemExit(3)'")
    monkeypatch.setenv("GENQ_SERVER_WAIT", "1800")
    log = tmp_path / "dead.log"
    job = slurm("sbatch", "--parsable", f"--output={log}", SBATCH)
    try:
        wait_for(lambda: not active(job), 90, 0.5, what="the task to end")
    finally:
        subprocess.run(["scancel", job])
    assert "died while starting" in log.read_text(), log.read_text()[-2000:]


def monitor_status(port: str) -> dict | None:
    try:
        return orjson.loads(httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=2).content)
    except (httpx.HTTPError, orjson.JSONDecodeError):
        return None
