"""The rollout part of `jetrl status`: what went wrong in the rollout workers since the run started,
as `jetrl up`'s display and `metrics.json` count it: episode attempts failed (by exception type),
prompts rejected, groups shrunk by episodes that returned None, groups `should_accept_fn` refused.
Summed over the workers, each at its last METRICS event (its totals are cumulative)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from schemas.messages import MessageError, MetricsEvent, decode
from schemas.subjects import METRICS_STREAM, Subjects
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
    js = nc.jetstream(timeout=timeout_s)
    try:
        sub = await js.pull_subscribe(
            Subjects(run).metrics("rollout"), stream=METRICS_STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, mem_storage=True),
        )
    except NotFoundError:
        return RolloutOutcomes()
    latest: dict[str, MetricsEvent] = {}
    try:
        pending = (await sub.consumer_info()).num_pending or 0
        seen = 0
        while seen < pending:
            try:
                msgs = await sub.fetch(min(512, pending - seen), timeout=timeout_s)
            except TimeoutError:
                break
            seen += len(msgs)
            for msg in msgs:
                try:
                    event = decode(MetricsEvent, msg.data)
                except MessageError:
                    continue
                latest[event.worker] = event
    finally:
        await sub.unsubscribe()
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
