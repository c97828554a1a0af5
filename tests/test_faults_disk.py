"""The output directory fills up mid-run: no torn line, claiming pauses with a clear log line,
and the run resumes and finishes once space returns."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
from pathlib import Path

import pytest
from faultkit import Consumer, check_truth, produce_once, record_figures, sim_kwargs, wait_done
from pipeline import wait_for, write_dataset

from genq.common.queue.keys import RunKeys


class FullDisk:
    """An output directory that runs out of space on demand: a 1 MiB tmpfs, filled by a filler
    file and freed by deleting it. Mounting needs root, which the suite has in its sandbox and
    in CI (RLIMIT_FSIZE was the alternative, but it also stops the consumer's own log file).
    Where it cannot mount, the test fails: a skip would hide that the disk-full path went
    untested."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        directory.mkdir(parents=True)
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(directory)],
                               capture_output=True, text=True)
        if mount.returncode:
            pytest.fail(f"cannot mount a small tmpfs here (run the suite as root, or where "
                        f"mount -t tmpfs is allowed): {mount.stderr.strip()}")
        self.filler = directory / "filler.bin"

    def fill(self) -> None:
        with open(self.filler, "wb", buffering=0) as f:
            for size in (1 << 16, 1 << 12, 1):
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * size)

    def free(self) -> None:
        self.filler.unlink()

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.dir)], check=False)


def whole_lines_only(directory: Path, run: str) -> bool:
    for shard in directory.glob(f"{run}.*.jsonl"):
        data = shard.read_bytes()
        if data and not data.endswith(b"\n"):
            return False
    return True


@pytest.mark.slow  # a full disk's window
@pytest.mark.timeout(150)
def test_disk_full_pauses_claiming_writes_no_torn_line_and_resumes(
        tmp_path, redis_url, r, run_name, sim_factory):
    n = 40
    produce_once(write_dataset(tmp_path / "d.jsonl", n), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.2))
    disk = FullDisk(tmp_path / "out")
    try:
        recovery_s, message, seen = through_a_full_disk(r, redis_url, run_name, sim, disk)
        assert str(disk.dir) in message
        assert os.strerror(errno.ENOSPC) in message
        assert seen["claiming_resumed"] >= 1
        figures = check_truth(r, redis_url, run_name, n, tmp_path)  # reads the shards: mounted
    finally:
        disk.close()
    assert figures["broken_shard_lines"] == 0
    record_figures("disk_full", recovery_s=recovery_s, pauses=seen["claiming_paused"], **figures)


def through_a_full_disk(r, redis_url: str, run_name: str, sim, disk: FullDisk):
    c = Consumer(redis_url, run_name, sim.url, disk.dir)
    try:
        wait_done(r, run_name, 5)
        disk.fill()

        def paused() -> list[dict]:
            return [e for e in c.events() if e.get("event") == "claiming_paused"]

        wait_for(paused, timeout=30, what="the consumer pausing on a full disk")
        message = paused()[0]["error"]
        time.sleep(2)
        # Writes failed meanwhile, yet every shard still ends in a whole line.
        assert whole_lines_only(disk.dir, run_name)
        assert c.proc.poll() is None
        before = r.bitcount(RunKeys(run_name).done)
        disk.free()
        freed_at = time.monotonic()
        wait_for(lambda: r.bitcount(RunKeys(run_name).done) > before, timeout=30,
                 interval=0.02, what="progress once space returned")
        recovery_s = round(time.monotonic() - freed_at, 2)
        assert c.wait(60) == 0, c.log()[-3000:]
        return recovery_s, message, c.event_names()
    finally:
        c.cleanup()

