"""The monitor's service as a neighbour on the network meets it: where it listens by default."""

from __future__ import annotations

import socket

import pytest
from test_monitor import Monitor, populate


def test_the_monitor_listens_on_loopback_only_by_default(redis_url, r, run_name, tmp_path):
    """No auth: unless --host says otherwise, only this machine reaches it. 127.0.0.2 is this
    machine too, but not the address 127.0.0.1 binds (0.0.0.0 answers on it)."""
    populate(r, run_name)
    monitor = Monitor(redis_url, run_name, tmp_path, host=None)
    try:
        assert monitor.get("/api/status")[0] == 200
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", monitor.port), timeout=5).close()
    finally:
        monitor.stop()
