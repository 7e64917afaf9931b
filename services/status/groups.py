"""The trainer part of `jetrl status`: what became of the trajectory groups it read, from its last
METRICS event (`total_<outcome>` since the run started), and the groups it terminated, by cause."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from nats.aio.client import Client as NATS

from schemas.messages import MessageError, MetricsEvent, decode
from schemas.metric_names import GROUP_OUTCOMES
from schemas.subjects import METRICS_STREAM, Subjects
from services.status.weights import _last_per_subject

OUTCOMES = GROUP_OUTCOMES
TERMINATED_PREFIX = "total_terminated_"
STALE_PREFIX = "total_stale_"


@dataclass
class TrainerGroups:
    step: int | None = None
    """The trainer's last reported step (None: it has not reported one)."""
    outcomes: dict[str, int] = field(default_factory=dict)
    """Groups read since the run started, by what became of them."""
    terminated: dict[str, int] = field(default_factory=dict)
    """Groups terminated (never trained, never redelivered), by cause."""
    stale: dict[str, int] = field(default_factory=dict)
    """Stale groups with a named cause (`earlier_run`: generated with an earlier run's weights)."""

    def as_dict(self) -> dict:
        return asdict(self)


async def trainer_groups(nc: NATS, run: str, timeout_s: float) -> TrainerGroups:
    status = TrainerGroups()
    for msg in await _last_per_subject(nc, Subjects(run).metrics("trainer"), timeout_s, stream=METRICS_STREAM):
        try:
            event = decode(MetricsEvent, msg.data)
        except MessageError:
            continue
        status.step = event.step
        status.outcomes = {k: int(event.values.get(f"total_{k}", 0)) for k in OUTCOMES}
        status.terminated = {k[len(TERMINATED_PREFIX):]: int(v) for k, v in sorted(event.values.items())
                             if k.startswith(TERMINATED_PREFIX) and v}
        status.stale = {k[len(STALE_PREFIX):]: int(v) for k, v in sorted(event.values.items()) if k.startswith(STALE_PREFIX) and v}
    return status


def render_groups(status: TrainerGroups) -> str:
    lines = ["trajectory groups (from the trainer's last step report)"]
    if status.step is None:
        lines.append("  the trainer has not reported a step yet")
        return "\n".join(lines)
    lines.append(f"  at step {status.step}: " + ", ".join(f"{k} {v}" for k, v in status.outcomes.items()))
    total = sum(status.terminated.values())
    causes = ", ".join(f"{k} {v}" for k, v in status.terminated.items())
    lines.append(f"  terminated: {total}" + (f" ({causes})" if causes else ""))
    if status.stale:
        lines.append("  stale by cause: " + ", ".join(f"{k} {v}" for k, v in status.stale.items()))
    return "\n".join(lines)
