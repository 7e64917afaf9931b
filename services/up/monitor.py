"""Watches a run through the bus: the METRICS stream (every service's events) and the weight-sync
reports, and keeps what the live display, the summary and the report need."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from schemas import metric_names as names
from schemas.messages import MessageError, MetricsEvent, WeightsLoaded, decode
from schemas.subjects import Subjects
from services.up.store import StoreState

# What the display reads from the trainer's events: the one spelling the trainer emits.
REWARD_KEYS = (names.REWARD_MEAN,)
ACCURACY_KEYS = (names.ACCURACY,)
STALENESS_KEYS = (names.STALENESS_MEAN,)
WAIT_KEYS = (names.DATA_WAIT_FRACTION,)
EVAL_PASS = names.EVAL_ACCURACY
OUTCOME_KEYS = ("episodes_failed_total", "rejected_total", "groups_shrunk_total", "groups_not_accepted_total",
                *names.CONSTRAINT_COUNTERS)


def pick(values: dict[str, float], keys: tuple[str, ...]) -> float | None:
    for key in keys:
        if key in values:
            return values[key]
    return None


def staleness_mean(values: dict[str, float]) -> float | None:
    """Mean staleness from the trainer's histogram keys `staleness_<k>` (groups k versions old)."""
    hist = {int(k.rsplit("_", 1)[1]): v for k, v in values.items() if k.startswith("staleness_") and k.rsplit("_", 1)[1].isdigit()}
    total = sum(hist.values())
    if "groups" in values and values["groups"] > 0:
        return sum(k * n for k, n in hist.items()) / values["groups"]
    return sum(k * n for k, n in hist.items()) / total if total else None


@dataclass
class RunView:
    started: float = field(default_factory=time.time)
    steps: list[dict[str, Any]] = field(default_factory=list)
    """One dict per trainer step event: step, version, time, and the event's values."""
    latest: dict[str, MetricsEvent] = field(default_factory=dict)
    """Last event per service/worker."""
    evals: list[dict[str, Any]] = field(default_factory=list)
    """One dict per eval round (service "eval"): step and the round's values."""
    servers: dict[str, int] = field(default_factory=dict)
    """Weight version loaded per inference server."""
    workflow_stats: list[dict[str, Any]] = field(default_factory=list)
    """The workflows' own statistics (AReaL's `stats_tracker`, keys `<scope>/<name>`): one dict per
    rollout metrics event that carried any, with its time and worker."""
    malformed: int = 0
    store: StoreState = field(default_factory=StoreState)
    """The embedded store's streams that cannot be written (store.py)."""
    target: float | None = None
    """A 10-step mean reward to watch for (`stop_at_reward`); None: none."""
    reached_at: int | None = None
    """The first step whose 10-step mean reward reached `target`, checked at every step as it arrives
    (a display refresh every 0.5 s sees only the window at that moment: a mean can cross and fall back
    between two refreshes)."""
    eval_lift: float | None = None
    """An eval pass-rate gain to watch for (`stop_at_eval_lift`): over the run's first round; None: none."""
    lifted_at: int | None = None
    """The step of the first eval round whose pass rate is `eval_lift` over the step-0 round's."""

    def add(self, event: MetricsEvent) -> None:
        self.latest[f"{event.service}/{event.worker}"] = event
        if event.service == "rollout":
            scoped = {k: v for k, v in event.values.items() if "/" in k}
            if scoped:
                self.workflow_stats.append({"time": event.time - self.started, "worker": event.worker, **scoped})
        if event.service == "eval" and event.step is not None:
            self.evals.append({"step": event.step, "time": event.time - self.started, **event.values})
            self._check_lift()
        if event.service == "trainer" and event.step is not None:
            if not self.steps or self.steps[-1]["step"] != event.step:
                values = dict(event.values)
                mean = staleness_mean(values)
                if mean is not None:
                    values.setdefault(names.STALENESS_MEAN, mean)
                self.steps.append({"step": event.step, "version": event.version, "time": event.time - self.started, **values})
                if self.target and self.reached_at is None and len(self.steps) >= 10 and (self.recent(REWARD_KEYS) or 0) >= self.target:
                    self.reached_at = event.step

    def _check_lift(self) -> None:
        """Rounds arrive as they are answered, not in step order: each is held against the step-0 round
        once that is in (a later round that came first counts then)."""
        if self.eval_lift is None or self.lifted_at is not None:
            return
        base = next((e.get(EVAL_PASS) for e in self.evals if e["step"] == 0), None)
        if base is None:
            return
        lifted = [e["step"] for e in self.evals if e["step"] > 0 and (e.get(EVAL_PASS) or 0.0) >= base + self.eval_lift - 1e-9]
        if lifted:
            self.lifted_at = min(lifted)

    def eval_at(self, step: int) -> float | None:
        """The pass rate of the eval round of `step`, if it is in."""
        return next((e.get(EVAL_PASS) for e in self.evals if e["step"] == step), None)

    @property
    def step(self) -> int:
        return self.steps[-1]["step"] if self.steps else 0

    def recent(self, keys: tuple[str, ...], n: int = 10) -> float | None:
        vals = [v for s in self.steps[-n:] if (v := pick(s, keys)) is not None]
        return sum(vals) / len(vals) if vals else None

    def rollout_rate(self, key: str = names.EPISODES_PER_S) -> float:
        return sum(e.values.get(key, 0.0) for k, e in self.latest.items() if k.startswith("rollout/"))

    def episode_outcomes(self) -> dict[str, float]:
        """What went wrong in the rollout workers, summed over them (their latest totals): episode
        attempts failed (`failed_by_<Type>`, and `episodes_failed_total`), prompts rejected, groups
        shrunk by episodes that returned None, constrained generations restarted and agent replies that
        missed their constraint."""
        out: dict[str, float] = {}
        for key, event in self.latest.items():
            if not key.startswith("rollout/"):
                continue
            for name, value in event.values.items():
                if name.startswith("failed_by_") or name in OUTCOME_KEYS:
                    out[name] = out.get(name, 0.0) + value
        return out

    def live_workers(self, service: str, within_s: float = 30.0) -> int:
        now = time.time()
        return sum(1 for k, e in self.latest.items() if k.startswith(f"{service}/") and now - e.time < within_s)


async def watch(nc: NATS, run: str, view: RunView) -> list[Any]:
    """Subscribe to the run's metrics and weight reports; returns the subscriptions."""
    subjects = Subjects(run)

    async def on_metrics(msg: Msg) -> None:
        try:
            view.add(decode(MetricsEvent, msg.data))
        except MessageError:
            view.malformed += 1

    async def on_loaded(msg: Msg) -> None:
        try:
            loaded = decode(WeightsLoaded, msg.data)
        except MessageError:
            view.malformed += 1
            return
        view.servers[loaded.server] = loaded.version

    return [
        await nc.subscribe(subjects.metrics_all, cb=on_metrics),
        await nc.subscribe(subjects.weights_loaded_all, cb=on_loaded),
    ]
