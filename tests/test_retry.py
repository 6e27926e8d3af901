"""The one retry policy (`protocol.util.retry`): what every loop that waits out an outage uses."""

from __future__ import annotations

import threading
import time

import pytest

from protocol.util.retry import Backoff, retry


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    b = Backoff(0.5, 3.0)
    assert [b.failed() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.failed() == 0.5


def test_a_stop_event_ends_a_wait_at_once() -> None:
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    started = time.monotonic()
    assert Backoff(30.0).wait(stop) is True
    assert time.monotonic() - started < 5


def _flaky(failures: int, error: type[Exception] = ConnectionError):
    calls = []

    def fn() -> str:
        calls.append(time.monotonic())
        if len(calls) <= failures:
            raise error(f"down {len(calls)}")
        return "up"

    return fn, calls


def test_retry_returns_once_the_call_succeeds_and_says_each_wait() -> None:
    fn, calls = _flaky(3)
    waits: list[float] = []
    assert retry(fn, on=(ConnectionError,), first=0.01, before_wait=lambda e, d: waits.append(d)) == "up"
    assert len(calls) == 4 and waits == [0.01, 0.02, 0.04]


def test_retry_gives_up_at_its_deadline_or_attempts_with_the_last_error() -> None:
    fn, calls = _flaky(100)
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="down"):
        retry(fn, on=(ConnectionError,), deadline_s=0.3, first=0.05, cap=0.05)
    assert time.monotonic() - started < 0.35 and len(calls) >= 5  # it does not sleep past the deadline
    fn, calls = _flaky(100)
    with pytest.raises(ConnectionError, match="down 3"):
        retry(fn, on=(ConnectionError,), attempts=3, first=0.001)
    assert len(calls) == 3


def test_retry_lets_other_errors_through_at_once_and_honours_the_servers_delay() -> None:
    fn, calls = _flaky(1, ValueError)
    with pytest.raises(ValueError):
        retry(fn, on=(ConnectionError,), first=0.001)
    assert len(calls) == 1
    fn, calls = _flaky(1)
    retry(fn, on=(ConnectionError,), first=5.0, delay_of=lambda err, delay: 0.01)  # a Retry-After of 10 ms
    assert calls[1] - calls[0] < 1.0


def test_retry_stops_when_asked() -> None:
    fn, calls = _flaky(100)
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    started = time.monotonic()
    with pytest.raises(ConnectionError):
        retry(fn, on=(ConnectionError,), first=30.0, stop=stop)
    assert time.monotonic() - started < 5 and len(calls) == 1


def test_retry_never_retries_the_final_subclasses() -> None:
    """A missing key is a store error, and final: `never` lets it through at once."""

    class Missing(ConnectionError):
        pass

    fn, calls = _flaky(5, Missing)
    with pytest.raises(Missing):
        retry(fn, on=(ConnectionError,), never=(Missing,), first=0.001)
    assert len(calls) == 1
