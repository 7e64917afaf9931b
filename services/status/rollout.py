"""The rollout part of `jetrl status`: what went wrong in the rollout workers since the run started,
as `jetrl up`'s display and `metrics.json` count it: episode attempts failed (by exception type),
prompts rejected, groups shrunk by episodes that returned None, groups `should_accept_fn` refused.
Summed over the workers, each at its last METRICS event (its totals are cumulative)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from nats.aio.client import Client as NATS

from schemas.messages import MetricsEvent
from schemas.subjects import Subjects
from services.status.events import metrics_events
from services.up.monitor import RunView
from services.up.report import outcome_text


@dataclass
class RolloutOutcomes:
    workers: int = 0
    """Rollout workers that have reported."""
    outcomes: dict[str, int] = field(default_factory=dict)
    """`episodes_failed_total`, `failed_by_<Type>`, `rejected_total`, `groups_shrunk_total`,
    `groups_not_accepted_total`: summed over the workers (absent: none reported it)."""

    def as_dict(self) -> dict:
        return asdict(self)


async def rollout_outcomes(nc: NATS, run: str, timeout_s: float) -> RolloutOutcomes:
    latest: dict[str, MetricsEvent] = {}
    for event in await metrics_events(nc, Subjects(run).metrics("rollout"), timeout_s):
        latest[event.worker] = event
    view = RunView(started=0.0)
    for event in latest.values():
        view.latest[f"rollout/{event.worker}"] = event
    return RolloutOutcomes(len(latest), {k: int(v) for k, v in sorted(view.episode_outcomes().items())})


def render_rollout(status: RolloutOutcomes) -> str:
    lines = ["rollout (from each worker's last metrics event)"]
    if not status.workers:
        lines.append("  no rollout worker has reported")
        return "\n".join(lines)
    text = outcome_text({k: float(v) for k, v in status.outcomes.items()})
    lines.append(f"  {status.workers} worker(s): " + (text or "no episode failed, none rejected, no group shrunk"))
    return "\n".join(lines)
