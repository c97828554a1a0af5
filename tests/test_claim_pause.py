"""How long a server's refusals pause new requests (consumer/backoff.py ClaimPause): a
moment for a refusal between successes (a 503 under load), as long as the server asks when
it sends Retry-After, and doubling up to MAX_BACKOFF_S while failures come in a row (a dead
server); only pauses worth a person's attention are logged."""

from __future__ import annotations

import pytest
import structlog

from genq.common.errors import ServerStalled, ServerUnavailable
from genq.consumer import backoff
from genq.consumer.backoff import FIRST_PAUSE_S, MAX_BACKOFF_S, RETRIES_IN_SLOT, ClaimPause


def test_a_refusal_between_successes_costs_a_moment(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(backoff.time, "monotonic", lambda: clock[0])
    pause = ClaimPause()
    with structlog.testing.capture_logs() as lines:
        for _ in range(150):  # one refusal, then successes, a second apart
            pause.trouble("HTTP 503")
            assert 0.5 * FIRST_PAUSE_S <= pause.remaining() <= 1.5 * FIRST_PAUSE_S
            clock[0] += 1.0
            pause.recovered()
    # The ordinary cost of a busy server: summed once a minute, not a line per refusal.
    assert [(x["event"], x["count"]) for x in lines] == [
        ("requests_refused", 1), ("requests_refused", 60), ("requests_refused", 60)]


def test_failures_in_a_row_double_the_pause_up_to_the_cap_and_are_logged(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(backoff.time, "monotonic", lambda: clock[0])
    pause = ClaimPause()
    pauses = []
    with structlog.testing.capture_logs() as lines:
        for _ in range(12):
            pause.trouble("connection refused")
            pause.trouble("connection refused")  # in flight during the pause: not counted
            pauses.append(pause.remaining())
            clock[0] += pause.remaining()
        pause.recovered()
    for i, got in enumerate(pauses):  # doubling, jittered by half either way, up to the cap
        base = min(FIRST_PAUSE_S * 2 ** i, MAX_BACKOFF_S)
        assert 0.5 * base <= got <= 1.5 * base, (i, got)
    events = [line["event"] for line in lines]
    assert events[-1] == "claiming_resumed" and "claiming_paused" in events


def test_retry_after_is_the_pause(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(backoff.time, "monotonic", lambda: clock[0])
    pause = ClaimPause()
    pause.trouble("HTTP 503", retry_after=3.0)
    assert pause.remaining() == 3.0


def test_a_slot_retries_a_refusal_itself_until_refusals_come_in_a_row():
    pause = ClaimPause()
    assert FIRST_PAUSE_S <= pause.in_slot(ServerUnavailable("HTTP 503")) <= 3 * FIRST_PAUSE_S
    assert pause.in_slot(ServerUnavailable("HTTP 503", retry_after=0.5)) == 0.5
    assert pause.in_slot(ServerUnavailable("HTTP 503", retry_after=5.0)) is None  # asks more
    assert pause.in_slot(ServerStalled("silent")) is None  # a hang: its task goes back
    assert pause.in_slot(ValueError("a bug")) is None
    pause.in_slot(ServerUnavailable("HTTP 503"))
    assert pause.failures == RETRIES_IN_SLOT
    assert pause.in_slot(ServerUnavailable("HTTP 503")) is None  # in a row: pause them all
    pause.recovered()
    assert pause.in_slot(ServerUnavailable("HTTP 503")) is not None


def test_a_retry_after_is_obeyed_up_to_the_configured_cap(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(backoff.time, "monotonic", lambda: clock[0])
    default, short = ClaimPause(), ClaimPause(max_retry_after=2.5)
    for pause in (default, short):
        pause.trouble("HTTP 503", retry_after=86400)
    assert default.remaining() == backoff.MAX_RETRY_AFTER_S == 60
    assert short.remaining() == 2.5
    asked = ClaimPause(max_retry_after=2.5)
    asked.trouble("HTTP 503", retry_after=1.5)  # less than the cap: as asked
    assert asked.remaining() == 1.5


def test_a_negative_retry_after_cap_is_one_clear_error(capsys):
    from genq.consumer.cli import parse

    with pytest.raises(SystemExit) as e:
        parse(["--server", "http://127.0.0.1:9", "--max-retry-after", "-1"])
    assert e.value.code == 2
    assert "--max-retry-after must be >= 0" in capsys.readouterr().err
