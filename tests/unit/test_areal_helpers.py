"""AReaL's helpers in jetrl behave as AReaL's: `AsyncRewardWrapper` (a process pool: a timed-out
attempt is retried and ends as 0, an exception propagates after the retries, a crashed process is
replaced), `stats_tracker` (scopes, scalars, masked stats, export), the gconfig helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from structlog.testing import capture_logs

from jetrl import AsyncRewardWrapper, GenerationHyperparameters, stats_tracker, workflow_context
from tests.reward_fns import exits_if, length, raises, sleepy


@pytest.fixture(autouse=True)
def pools() -> Iterator[None]:
    yield
    AsyncRewardWrapper.shutdown()


async def test_a_reward_runs_in_another_process_and_timeouts_end_as_zero_after_the_retries() -> None:
    assert await AsyncRewardWrapper(length, max_workers=1)(completion="abcd") == 4.0
    with capture_logs() as logs:
        slow = AsyncRewardWrapper(sleepy, timeout_seconds=0.3, max_workers=1, max_retries=1)
        assert await slow(completion="abc", sleep_s=30) == 0.0  # AReaL's 0 after the last timeout
    assert [e["attempt"] for e in logs if e["event"] == "reward timed out"] == [1, 2]
    # the timed-out call's process was ended: the pool still answers at once
    assert await asyncio.wait_for(AsyncRewardWrapper(length, max_workers=1)(completion="ab"), 20) == 2.0


async def test_an_exception_propagates_after_the_retries_and_a_dead_process_is_replaced() -> None:
    with capture_logs() as logs, pytest.raises(KeyError, match="no such field"):
        await AsyncRewardWrapper(raises, max_workers=1, max_retries=2)()
    assert len([e for e in logs if e["event"] == "reward function raised"]) == 3
    from pebble import ProcessExpired

    with pytest.raises(ProcessExpired):
        await AsyncRewardWrapper(exits_if, max_workers=1, max_retries=0)(crash=True)
    assert await AsyncRewardWrapper(exits_if, max_workers=1)(completion="xyz") == 3.0


def test_stats_tracker_records_under_the_workflows_scope() -> None:
    stats_tracker.export_all()  # start empty
    with workflow_context.set(is_eval=True):
        tracker = stats_tracker.get(workflow_context.stat_scope())
        tracker.scalar(reward=1.0, num_turns=2)
        tracker.scalar(reward=0.0, num_turns=4)
        with tracker.scope("turn"):
            tracker.denominator(n_tokens=torch.tensor([True, True, False]))
            tracker.stat(denominator="n_tokens", logp=torch.tensor([-1.0, -3.0, -100.0]))
    out = stats_tracker.export_all()
    assert out["eval-rollout/reward"] == 0.5 and out["eval-rollout/num_turns"] == 3.0
    assert (out["eval-rollout/turn/logp/avg"], out["eval-rollout/turn/logp/min"], out["eval-rollout/turn/logp/max"]) == (-2.0, -3.0, -1.0)
    assert stats_tracker.export_all() == {}  # reset


def test_gconfig_helpers_as_areal_has_them() -> None:
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    g = GenerationHyperparameters(max_new_tokens=7, stop_token_ids=[2, 5]).new_with_stop_and_pad_token_ids(tok)
    assert g.stop_token_ids == [2, 5, 0]
    args = g.to_openai_args_dict()
    assert args["max_completion_tokens"] == 7 and args["n"] == 1 and "top_k" not in args and "stop_token_ids" not in args
    assert g.to_openai_responses_args_dict()["max_output_tokens"] == 7
    assert g.to_openai_agents_model_settings_dict(exclude_args=["n_samples"])["max_tokens"] == 7
    with pytest.raises(ValueError, match="api_format"):
        g.to_openai_args_dict(api_format="nope")
