"""Names of the figures services publish on the METRICS stream that other services read (the live
display of `jetrl up`, `jetrl status`, `jetrl plot`, the benches, the tests). One spelling each,
defined here, so a reader cannot look for a name nothing emits."""

from __future__ import annotations

from typing import Literal, get_args

GroupOutcome = Literal["accepted", "stale", "rejected", "filtered", "duplicate", "foreign", "malformed"]
"""What the trainer's intake made of one trajectory message (`Verdict.outcome`): trained, too old,
a rejection marker, zero-variance, already seen, another incarnation's prompt, or terminated. Each is
a name on the wire: `total_<outcome>` since the run started and `<outcome>_groups` in each step."""
GROUP_OUTCOMES: tuple[GroupOutcome, ...] = get_args(GroupOutcome)

# the trainer, one event per step
REWARD_MEAN = "reward_mean"
ACCURACY = "accuracy"
STALENESS_MAX = "staleness_max"
STALENESS_HIST_PREFIX = "staleness_"
"""`staleness_<k>`: groups of this step trained k versions after the oldest weights they used."""
STALENESS_MEAN = "staleness_mean"
"""Not emitted: computed by readers from the `staleness_<k>` histogram."""
DATA_WAIT_FRACTION = "data_wait_fraction"
STEP_TIME_S = "step_time_s"
TRAIN_TIME_S = "train_time_s"
PUBLISH_TIME_S = "publish_time_s"
TOKENS_PER_S = "tokens_per_s"
SAMPLES = "samples"
GROUPS = "groups"
FEEDER_DROPPED = "feeder_dropped"
TOTAL_PREFIX = "total_"
"""`total_<outcome>`: the intake's verdicts since the run started (accepted, stale, terminated_<cause>...)."""
EVAL_REWARD_MEAN = "eval_reward_mean"
EVAL_ACCURACY = "eval_accuracy"
"""An eval round's pass rate: the share of its samples whose reward is 1."""

# a rollout worker
EPISODES_PER_S = "episodes_per_s"
CONSTRAINED_RESTARTS_TOTAL = "constrained_restarts_total"
"""Constrained generations (json_schema / regex / ebnf) an abort cut and the engine restarted from the
prompt, their partial output dropped (a grammar's state cannot pass to a continuation), since the start."""
CONSTRAINT_UNMET_TOTAL = "constraint_unmet_total"
"""Agent completions that missed their `tool_choice` / `response_format` (answered 422, recorded), since
the start: an invalid tool call or JSON reply."""
CONSTRAINT_COUNTERS = (CONSTRAINED_RESTARTS_TOTAL, CONSTRAINT_UNMET_TOTAL)
