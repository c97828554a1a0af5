"""Two nodes on one machine: each a network namespace with a hostname of its own (`unshare -n
-u`), an SGLang server on the same loopback port and a consumer, both sharing one Redis through
a unix socket, as two Slurm nodes share one Redis. A loopback URL names a server only on its
own node: the two are two servers, both driven."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from collections import Counter

import pytest
from conftest import REPO, RedisServer, free_port, genq, genq_env
from pipeline import read_jsonl, write_dataset

from genq.consumer.servers import identity

NODE = """
hostname {host}; ip link set lo up
{python} -m genq sim --port {port} --time-scale 40 --max-running-requests 4 >{out}/sim.log 2>&1 &
sim=$!
{python} -m genq consume --server http://127.0.0.1:{port} --out {out} --burst --name {host} \
  >{out}/consumer.log 2>&1
rc=$?
kill $sim; wait; exit $rc
"""


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
def test_two_nodes_with_the_same_loopback_port_are_two_servers(tmp_path, run_name):
    sock = tmp_path / "redis.sock"
    redis = RedisServer(tmp_path, None, "--unixsocket", str(sock), "--unixsocketperm", "700")
    redis.start()
    try:
        url = f"unix://{sock}?db=0"
        n = 160
        genq("produce", str(write_dataset(tmp_path / "d.jsonl", n)), "--once",
             "--max-tokens", "300", redis_url=url, run=run_name)
        port, nodes = free_port(), {}
        for host in ("node-a", "node-b"):
            out = tmp_path / host
            out.mkdir()
            script = NODE.format(host=host, python=sys.executable, port=port, out=out)
            nodes[host] = subprocess.Popen(["unshare", "-n", "-u", "bash", "-c", script],
                                           cwd=REPO, env=genq_env(url, run_name))
        for host, proc in nodes.items():
            assert proc.wait(150) == 0, (tmp_path / host / "consumer.log").read_text()[-3000:]
        status = json.loads(genq("status", "--json", redis_url=url, run=run_name).stdout)
        export = tmp_path / "export.jsonl"
        genq("export", "--out", str(export), redis_url=url, run=run_name)
    finally:
        redis.stop(kill=True)
    records = read_jsonl(export)
    assert Counter(rec["index"] for rec in records) == Counter(range(n))
    by_server = Counter(rec["server"] for rec in records)
    assert sorted(by_server) == [f"http://127.0.0.1:{port}#node-a",
                                 f"http://127.0.0.1:{port}#node-b"], by_server
    # status (--json) tells them apart too: a row for each, each with answers to its rate
    rates = {row["server"]: row["req_per_s"] for row in status["servers"]}
    assert sorted(rates) == sorted(by_server) and all(rates.values()), rates


def test_only_a_loopback_url_is_named_with_its_node():
    host = socket.gethostname()
    for local in ("http://127.0.0.1:30000", "http://localhost:30000", "http://[::1]:30000",
                  "http://0.0.0.0:30000", "http://127.0.1.1:8000/"):
        assert identity(local) == f"{local}#{host}"
    for remote in ("http://gpu0:30000", "http://10.0.0.7:30000", "https://sglang.example.com"):
        assert identity(remote) == remote
