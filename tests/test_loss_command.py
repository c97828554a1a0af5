"""While Redis has lost a run, the recover command `genq status` and a restarted producer print
is whole: it names every output directory the run had, also one whose consumer is gone, and it
runs as printed. Where the directories are not known, they say what is missing, not a command
that would be refused."""

from __future__ import annotations

import re
import shlex
import shutil
import signal

import pytest
from conftest import genq
from faultkit import Background, Consumer, private_redis, sim_kwargs
from pipeline import wait_for, write_dataset

from genq.common.data import manifest as manifests
from genq.common.queue import heartbeats
from genq.common.queue.keys import RunKeys

N = 400


def printed_command(text: str) -> list[str]:
    [command] = re.findall(r"genq recover --shards [^`\n]*", text)
    return shlex.split(command)


@pytest.mark.slow  # a Redis loss and its recover, twice
@pytest.mark.timeout(240)
@pytest.mark.parametrize("gone", [False, True], ids=["kept", "b-deleted"])
def test_the_recover_command_printed_during_a_loss_names_every_output_directory(
        tmp_path, run_name, sim_factory, gone):
    """Also when b's directory went with its node: the command then names what exists, and
    --partial, since b's results can only run again."""
    data = write_dataset(tmp_path / "d.jsonl", N)
    sim = sim_factory(**sim_kwargs(0.5))
    k, a_out, b_out = RunKeys(run_name), tmp_path / "a", tmp_path / "b"
    args = ("produce", str(data), "--max-tokens", "300", "--once")
    with private_redis() as srv:  # no AOF: FLUSHALL is a loss
        url, r = srv.url, srv.client()
        genq(*args, redis_url=url, run=run_name)
        a = Consumer(url, run_name, sim.url, a_out, name="a")
        b = Consumer(url, run_name, sim.url, b_out, name="b")
        producer = None
        try:
            # a's manifest lists b's directory too; then b stops for good.
            wait_for(lambda: len((manifests.find(a_out, run_name) or {}).get("out_dirs", ()))
                     == 2 and r.bitcount(k.done) >= 10, timeout=60, what="both working")
            b.signal(signal.SIGTERM)
            assert b.wait(60) == 0, b.log()[-3000:]
            if gone:
                shutil.rmtree(b_out)
            r.flushall()
            wait_for(lambda: any(beat.get("run_state") == "lost"
                                 for beat in heartbeats.read(r, k).values()),
                     timeout=20, what="a waiting for the run")
            status = genq("status", redis_url=url, run=run_name, check=False)
            assert status.returncode != 0 and "lost its state" in status.stderr
            command = printed_command(status.stderr)
            assert str(a_out) in command, status.stderr
            assert (str(b_out) in command, "--partial" in command) == (not gone, gone), command
            assert str(b_out) in status.stderr, "the sentence still names the directory gone"
            producer = Background(url, run_name, *args[:-1], "--window", "8")
            [said] = wait_for(lambda: [e for e in producer.events()
                                       if e.get("event") == "run_state_lost"],
                              timeout=30, what="the restarted producer's command")
            assert printed_command(said["command"]) == command, said
            # The command runs as printed.
            assert genq(*command[1:], redis_url=url, run=run_name).returncode == 0
            assert a.wait(120) == 0, a.log()[-3000:]
        finally:
            for service in (a, b, producer):
                if service is not None:
                    service.cleanup()
        r.close()


def test_status_without_waiting_consumers_names_no_command_it_cannot_complete(
        redis_url, run_name):
    st = genq("status", redis_url=redis_url, run=run_name, check=False)
    assert st.returncode != 0 and "unknown run" in st.stderr
    assert "DIR" not in st.stderr and "every consumer's output directory" in st.stderr
