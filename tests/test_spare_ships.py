"""A consumer restarted as a spare (another holds its server) on the --out of a dead one ships
the leftover shards it finds there while it waits, and on SIGTERM says what it leaves unshipped:
else they wait, unseen, until it takes a server."""

from __future__ import annotations

import signal

import orjson
import pytest
from conftest import genq
from faultkit import produce_once, sim_kwargs
from pipeline import wait_for, write_dataset
from test_s3 import URI, s3  # noqa: F401 (the fixture)
from test_server_leasing import Replica

from genq.common.data.shards import closed_shards
from genq.common.queue.keys import RunKeys
from genq.common.store import s3 as store


@pytest.mark.slow  # a kill
def test_a_spare_ships_a_dead_consumers_leftover_shards(
        tmp_path, redis_url, r, run_name, sim_factory, s3):  # noqa: F811
    client, proxy = s3
    k, out, uri = RunKeys(run_name), tmp_path / "out", store.parse_uri(URI)
    produce_once(write_dataset(tmp_path / "d.jsonl", 600), redis_url, run_name)
    sim = sim_factory(**sim_kwargs(0.5, max_running_requests=8))
    ship = ("--s3-uri", URI, "--shard-records", "5")
    proxy.set_mode("refuse")  # S3 away: the shards stay on disk
    services = [Replica(redis_url, run_name, [sim.url], out, "gpu0", *ship)]
    try:
        wait_for(lambda: len(closed_shards(out, run_name)) >= 2, timeout=60, what="2 shards")
        services[0].signal(signal.SIGKILL)
        services[0].wait(10)
        left = closed_shards(out, run_name)
        services.append(Replica(redis_url, run_name, [sim.url], tmp_path / "o2", "holder"))
        wait_for(services[1].driving, timeout=30, what="another consumer driving the server")
        for reachable in (False, True):
            proxy.set_mode("pass" if reachable else "refuse")
            spare = Replica(redis_url, run_name, [sim.url], out, "gpu0", *ship)
            services.append(spare)
            wait_for(lambda: spare.said("server_busy"), timeout=30, what="a spare")  # noqa: B023
            if reachable:
                wait_for(lambda: len(store.shard_keys(client, uri, run_name)) >= len(left),
                         timeout=30, what="the leftover shards in S3")
            spare.signal(signal.SIGTERM)
            assert spare.wait(30) == int(not reachable), spare.log()[-3000:]
            assert ("shard(s) not shipped to " + URI in spare.log()) == (not reachable)
        assert r.hlen(k.shipped) >= len(left) and not spare.driving()
        status = genq("status", "--json", redis_url=redis_url, run=run_name).stdout
        assert orjson.loads(status)["shipping"]["shards_pending"] == 0  # none stranded unseen
    finally:
        for service in services:
            service.cleanup()
