"""A full store as nats-server 2.15 words it (the texts below are its own, from a 48 MB tmpfs):
recognised, with the stream named, and never confused with an outage or another refusal."""

from __future__ import annotations

from pathlib import Path

import nats.errors
import nats.js.errors
import pytest

from services.common.busretry import retryable
from services.common.storefull import describe, store_full, stream_named_in

NO_SPACE = "write /runs/r/nats/jetstream/jetstream/$G/streams/OBJ_WEIGHTS/msgs/1.blk: no space left on device"


def test_a_write_refused_for_space_names_its_stream_and_is_retried() -> None:
    refused = nats.js.errors.ServerError(code=500, err_code=10051, description=NO_SPACE)
    assert store_full(refused) == "OBJ_WEIGHTS" and retryable(refused)
    limit = nats.js.errors.ServiceUnavailableError(code=503, err_code=10023, description="insufficient resources")
    assert store_full(limit) == "" and retryable(limit), "the server's max_file_store reached (measured)"
    account = nats.js.errors.ServerError(code=500, err_code=10047, description="insufficient storage resources available")
    assert store_full(account) == "" and retryable(account)


def test_other_errors_are_not_a_full_store() -> None:
    other = nats.js.errors.ServerError(code=500, err_code=10051, description="stream store failed: some other fault")
    assert store_full(other) is None and not retryable(other)
    assert store_full(nats.errors.TimeoutError()) is None, "a timeout alone looks like an outage"
    assert store_full(nats.js.errors.BadRequestError(code=400, err_code=10058, description="stream name already in use")) is None


def test_the_stream_is_read_from_either_wording_and_described_in_one_line() -> None:
    assert stream_named_in("JetStream stream '$G > OBJ_WEIGHTS' write error: " + NO_SPACE) == "OBJ_WEIGHTS"
    assert stream_named_in("JetStream stream 'ACC > METRICS' write error: disk") == "METRICS"
    assert stream_named_in("nothing named") == ""
    line = describe({"TRAJECTORIES": "JetStream stream '$G > TRAJECTORIES' write error: " + NO_SPACE, "METRICS": NO_SPACE})
    assert line == "STORE FULL: METRICS, TRAJECTORIES (no space left on device)"


def test_the_display_says_store_full_at_once_and_when_it_is_writable_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    from services.up.display import Display
    from services.up.monitor import RunView
    from services.up.settings import UpSettings
    from services.up.stack import Stack

    view = RunView()
    lines = Display(UpSettings(display="lines"), view, Stack(tmp_path, {}))
    view.store.full = {"TRAJECTORIES": "JetStream stream '$G > TRAJECTORIES' write error: " + NO_SPACE}
    lines.refresh()
    lines.refresh()  # said once, not at every refresh
    view.store.full = {}
    lines.refresh()
    assert capsys.readouterr().out == "STORE FULL: TRAJECTORIES (no space left on device)\nstore writable again\n"

    view.store.full = {"METRICS": NO_SPACE}
    console = Console(width=200, record=True)
    console.print(Display(UpSettings(display="live"), view, Stack(tmp_path, {}))._table())
    assert "STORE FULL: METRICS (no space left on device): the run waits until space returns" in console.export_text()


def test_a_full_store_is_waited_for_past_the_outage_budget() -> None:
    """An outage is given up after the budget; a write refused for want of space is retried past it
    (space returns when someone makes room, however long that takes)."""
    import asyncio
    import time

    from services.common.busretry import Backoff, BusUnavailable, RetryPolicy

    async def retried_for(exc: BaseException, seconds: float) -> bool:
        backoff = Backoff("publish", give_up_after_s=0.05, policy=RetryPolicy())
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            try:
                await backoff.failed(exc)
            except BusUnavailable:
                return False
        return True

    refused = nats.js.errors.ServerError(code=500, err_code=10051, description=NO_SPACE)
    assert asyncio.run(retried_for(refused, 0.3))
    assert not asyncio.run(retried_for(nats.errors.TimeoutError(), 0.3))


def test_a_rollout_write_refused_for_space_is_a_full_store_and_a_timeout_alone_is_not() -> None:
    import asyncio

    from services.common.storefull import StoreAlarm

    alarm = StoreAlarm()  # no monitor address: a timeout cannot be told from an outage
    refused = nats.js.errors.ServerError(code=500, err_code=10051, description=NO_SPACE)
    assert asyncio.run(alarm.write_failed(refused, "TRAJECTORIES", "publish"))
    assert not asyncio.run(alarm.write_failed(nats.errors.TimeoutError(), "TRAJECTORIES", "publish"))
