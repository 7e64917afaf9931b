"""The figures of one trainer step, as the METRICS stream carries them (names in `schemas/metric_names.py`
for those other services read): the batch's rewards and staleness, the intake's verdicts this step and
since the start, where the step's time went, and the feeder's counters."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from schemas.metric_names import GROUP_OUTCOMES

if TYPE_CHECKING:
    from services.trainer.intake import Group
    from services.trainer.loop import Trainer


def step_values(trainer: Trainer, batch: dict[str, Any], groups: list[Group], stats: dict[str, float], before: Counter[str],
                times: tuple[float, float, float, float]) -> dict[str, float]:
    """`times`: the step's start, data ready, training done, end (monotonic seconds)."""
    t0, t_data, t_train, t_end = times
    counts = trainer.intake.counts - before
    rewards = batch["rewards"]
    values = dict(stats)
    stale_hist = Counter(trainer.version - 1 - g.head_version for g in groups)
    values.update({f"staleness_{k}": float(v) for k, v in sorted(stale_hist.items())})
    tokens = float(batch["attention_mask"].sum())
    values.update({
        "reward_mean": float(rewards.mean()),
        "accuracy": float((rewards >= 1.0).mean()),
        "staleness_max": float(max(stale_hist)),
        "groups": float(len(groups)),
        "samples": float(rewards.size),
        **{f"{outcome}_groups": float(counts[outcome])
           for outcome in GROUP_OUTCOMES if outcome != "accepted"},
        "step_time_s": t_end - t0,
        "train_time_s": t_train - t_data,
        "publish_time_s": t_end - t_train,
        # what publishing the weights cost this step: gathering them (and writing the checkpoint, on
        # the disk path) inside the training call, plus waiting on the publish itself
        "publish_share": (values.get("weights_gather_s", 0.0) + t_end - t_train) / max(t_end - t0, 1e-9),
        "data_wait_fraction": (t_data - t0) / max(t_end - t0, 1e-9),
        "tokens_per_s": tokens / max(t_train - t_data, 1e-9),
        "last_seq": float(trainer.last_seq),
    })
    for key, total in trainer.intake.counts.items():
        values[f"total_{key}"] = float(total)
    if trainer.feeder is not None:
        values.update(trainer.feeder.metric_values())
    return values
