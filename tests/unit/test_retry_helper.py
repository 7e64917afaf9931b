"""`busretry.retry`: the one loop for retries that are no NATS outage (a cluster still placing a stream,
an inference server that did not resume)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.busretry import retry


class Flaky:
    """Fails with `error` the first `failures` calls, then answers "ok"."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


def test_an_accepted_error_is_retried_until_the_call_succeeds_and_each_retry_is_reported() -> None:
    flaky, seen = Flaky(2, ConnectionError("away")), []
    answer = asyncio.run(retry(flaky, when=lambda exc: isinstance(exc, ConnectionError), attempts=3, initial_s=0.001,
                               on_retry=lambda exc, n: seen.append((str(exc), n))))
    assert (answer, flaky.calls, seen) == ("ok", 3, [("away", 1), ("away", 2)])


def test_the_last_error_itself_ends_it_when_the_attempts_are_spent_and_another_error_at_once() -> None:
    flaky = Flaky(5, ConnectionError("still away"))
    with pytest.raises(ConnectionError, match="still away"):
        asyncio.run(retry(flaky, when=lambda exc: isinstance(exc, ConnectionError), attempts=3, initial_s=0.001))
    assert flaky.calls == 3
    refused = Flaky(5, ValueError("bad request"))
    with pytest.raises(ValueError, match="bad request"):
        asyncio.run(retry(refused, when=lambda exc: isinstance(exc, ConnectionError), attempts=3, initial_s=0.001))
    assert refused.calls == 1


def test_a_spent_time_budget_ends_it() -> None:
    flaky = Flaky(10**6, ConnectionError("away"))
    with pytest.raises(ConnectionError):
        asyncio.run(retry(flaky, when=lambda exc: True, budget_s=0.0))
    assert flaky.calls == 1  # no time left after the first failure
