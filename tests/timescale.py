"""The tests' one time scale: the leases, visibility timeouts, grace periods, Retry-After caps and
fault windows that tests give genq are multiples of TICK, never bare constants, so a test of a
60 s cap proves the cap in a second (genq takes each as a setting: --visibility-timeout,
--server-lease, --grace, --max-retry-after). A slower machine stretches them all at once:
GENQ_TEST_TICK=1 doubles every one.

Tests wait for the state they need (tests/pipeline.py `wait_for`) rather than sleeping; a sleep
is left only where the test proves that nothing happens for a while, and then it sleeps in
ticks."""

from __future__ import annotations

import os

TICK = float(os.environ.get("GENQ_TEST_TICK", "0.5"))


def ticks(n: float) -> float:
    """n ticks in seconds."""
    return round(n * TICK, 3)


VT = ticks(4)  # a task's visibility timeout (lease), renewed every third of it
SERVER_LEASE = ticks(6)  # a consumer's lease on its server
GRACE = ticks(4)  # what a signalled consumer gives its in-flight requests
RETRY_AFTER_CAP = ticks(4)  # --max-retry-after: the longest a server's Retry-After pauses
FAULT_WINDOW = ticks(6)  # how long a server or Redis fault lasts before it is lifted
