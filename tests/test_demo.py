"""The README's first command: `genq demo` runs the whole pipeline and exports every prompt,
touching nothing of the user's: no Redis it was not pointed at, no file in the current
directory, and closing advice that still works once it has exited."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, free_port, genq_env
from pipeline import read_jsonl


def advice(stdout: str) -> list[str]:
    return [line.split("$ ", 1)[1] for line in stdout.splitlines()
            if line.startswith("  $ ")]


@pytest.mark.timeout(180)
def test_demo_runs_the_pipeline_end_to_end(tmp_path, redis_url):
    out = tmp_path / "demo.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "genq", "demo", "--prompts", "150", "--time-scale", "400",
         "--monitor-port", str(free_port()), "--out", str(out)],
        env=genq_env(redis_url, "unused"), cwd=REPO, capture_output=True, text=True,
        timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exported 150 records (150 done of 150)" in proc.stdout
    records = read_jsonl(out)
    assert sorted(r["index"] for r in records) == list(range(150))
    # REDIS_URL was set, so the run stays there and the advice may name `genq status`.
    assert any("genq status" in c for c in advice(proc.stdout))


@pytest.mark.timeout(180)
def test_demo_without_redis_url_touches_nothing(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in genq_env("unused", "unused").items()
           if k not in ("REDIS_URL", "GENQ_RUN")}
    env["TMPDIR"] = str(tmp_path / "tmp")
    os.mkdir(env["TMPDIR"])
    proc = subprocess.run(
        [sys.executable, "-m", "genq", "demo", "--prompts", "60", "--time-scale", "400"],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "a private Redis (AOF" in proc.stdout
    assert "exported 60 records (60 done of 60)" in proc.stdout
    # The export went to a new directory under the temp dir, not the current directory.
    out = re.search(r" to (\S+results\.jsonl)", proc.stdout).group(1)
    assert out.startswith(env["TMPDIR"]) and len(read_jsonl(Path(out))) == 60
    assert list(cwd.iterdir()) == []
    # Everything but the export is gone: the private Redis and its AOF, shards and logs.
    assert os.listdir(env["TMPDIR"]) == [os.path.basename(os.path.dirname(out))]
    # Each command of the closing advice works now that every demo service has stopped.
    # Nothing printed at the end suggests a command that needs the Redis now gone.
    ending = proc.stdout[proc.stdout.index("exported 60 records"):]
    assert "genq requeue" not in ending and "genq status" not in ending
    commands = advice(proc.stdout)
    assert commands and not any("http://" in c for c in commands)
    for command in commands:
        done = subprocess.run(command, shell=True, env=env, cwd=cwd, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, (command, done.stderr)


def test_write_dataset_keeps_an_existing_file(tmp_path):
    path = tmp_path / "d" / "prompts.jsonl"
    cmd = [sys.executable, "-m", "genq", "demo", "--write-dataset", str(path), "--prompts", "7"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    assert len(read_jsonl(path)) == 7
    path.write_text('{"prompt": "mine"}\n')
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    assert path.read_text() == '{"prompt": "mine"}\n'


def children(pid: int) -> set[int]:
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow  # a kill
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_a_killed_demo_leaves_no_process_behind(tmp_path):
    env = {k: v for k, v in genq_env("unused", "unused").items() if k != "REDIS_URL"}
    env["TMPDIR"] = str(tmp_path)
    # Slow enough that it is mid-run when killed.
    demo = subprocess.Popen(
        [sys.executable, "-m", "genq", "demo", "--prompts", "5000", "--time-scale", "5"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert demo.stdout.readline().startswith("run "), "the demo did not start"
        started = children(demo.pid)
        # redis-server, 2 simulators, 2 consumers, the monitor.
        assert len(started) == 6, started
    finally:
        demo.kill()
        demo.wait(timeout=10)
        demo.stdout.close()
    deadline = time.monotonic() + 20
    while any(alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in started if alive(p)]
