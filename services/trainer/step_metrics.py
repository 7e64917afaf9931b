"""The figures of one trainer step, as the METRICS stream carries them (names in `schemas/metric_names.py`
for those other services read): the batch's rewards and staleness, the intake's verdicts this step and
since the start, where the step's time went, and the feeder's counters."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.metric_names import (
    ACCURACY,
    DATA_WAIT_FRACTION,
    GROUP_OUTCOMES,
    GROUPS,
    PUBLISH_TIME_S,
    REWARD_MEAN,
    SAMPLES,
    STALENESS_HIST_PREFIX,
    STALENESS_MAX,
    STEP_TIME_S,
    TOKENS_PER_S,
    TOTAL_PREFIX,
    TRAIN_TIME_S,
)


@dataclass(frozen=True)
class StepFacts:
    """What the step reports besides its batch, handed over by the trainer (this module reads no
    trainer): the version being trained, the intake's verdicts since the start and before this step,
    the last trajectory sequence consumed, and the feeder's counters."""

    version: int
    counts: Counter[str]
    before: Counter[str]
    last_seq: int
    feeder: Mapping[str, float] = field(default_factory=dict)


def step_values(facts: StepFacts, batch: dict[str, Any], heads: list[int], stats: dict[str, float],
                times: tuple[float, float, float, float]) -> dict[str, float]:
    """`heads`: the oldest weight version of each group's trained tokens; `stats`: what the training call
    measured; `times`: the step's start, data ready, training done, end (monotonic seconds)."""
    t0, t_data, t_train, t_end = times
    counts = facts.counts - facts.before
    rewards = batch["rewards"]
    values = dict(stats)
    stale_hist = Counter(facts.version - 1 - head for head in heads)
    values.update({f"{STALENESS_HIST_PREFIX}{k}": float(v) for k, v in sorted(stale_hist.items())})
    tokens = float(batch["attention_mask"].sum())
    values.update({
        REWARD_MEAN: float(rewards.mean()),
        ACCURACY: float((rewards >= 1.0).mean()),
        STALENESS_MAX: float(max(stale_hist)),
        GROUPS: float(len(heads)),
        SAMPLES: float(rewards.size),
        **{f"{outcome}_groups": float(counts[outcome])
           for outcome in GROUP_OUTCOMES if outcome != "accepted"},
        STEP_TIME_S: t_end - t0,
        TRAIN_TIME_S: t_train - t_data,
        PUBLISH_TIME_S: t_end - t_train,
        # what publishing the weights cost this step: gathering them (and writing the checkpoint, on
        # the disk path) inside the training call, plus waiting on the publish itself
        "publish_share": (values.get("weights_gather_s", 0.0) + t_end - t_train) / max(t_end - t0, 1e-9),
        DATA_WAIT_FRACTION: (t_data - t0) / max(t_end - t0, 1e-9),
        TOKENS_PER_S: tokens / max(t_train - t_data, 1e-9),
        "last_seq": float(facts.last_seq),
    })
    for key, total in facts.counts.items():
        values[f"{TOTAL_PREFIX}{key}"] = float(total)
    values.update(facts.feeder)
    return values
