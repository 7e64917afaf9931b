"""`jetrl up`'s stack plan (services/up/plan.py): its checks, and the executor on real processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.up.plan import HttpReady, Step, check_plan, execute
from services.up.stack import Stack

NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing answers HTTP there


def test_a_plan_names_each_step_once_and_waits_only_for_earlier_steps() -> None:
    with pytest.raises(ValueError, match="'a' appears twice"):
        check_plan([Step("a", "m", {}), Step("a", "m", {})])
    with pytest.raises(ValueError, match=r"'a' waits for \['b'\]"):
        check_plan([Step("a", "m", {}, after=("b",)), Step("b", "m", {})])


def test_a_step_starts_only_once_what_it_waits_for_is_ready_and_the_deadline_names_the_probe(tmp_path: Path) -> None:
    stack = Stack(tmp_path, {})
    plan = [Step("server", "services.no_such_module", {}, required=False, ready=HttpReady(NOWHERE, what="test server")),
            Step("client", "services.no_such_module", {}, after=("server",))]
    try:
        with pytest.raises(TimeoutError, match=f"test server {NOWHERE} not healthy within 0.5s"):
            asyncio.run(execute(plan, stack, 0.5, asyncio.Event()))
    finally:
        stack.stop(5.0)
    assert [p.name for p in stack.procs] == ["server"]


def test_a_required_process_that_ends_while_starting_is_the_error_with_its_log(tmp_path: Path) -> None:
    stack = Stack(tmp_path, {})
    plan = [Step("broken", "services.no_such_module", {}), Step("server", "services.no_such_module", {}, required=False,
                                                                 ready=HttpReady(NOWHERE))]
    try:
        with pytest.raises(RuntimeError, match=r"broken exited with 1 while starting:\n.*No module named services.no_such_module"):
            asyncio.run(execute(plan, stack, 60.0, asyncio.Event()))
    finally:
        stack.stop(5.0)
