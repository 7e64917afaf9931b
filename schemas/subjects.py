"""Subject, stream, consumer and bucket names, and the stream configurations, in one place.

Streams are shared by every run on a server (their subjects hold a `*` for the run); consumers are
per run. See docs/design.md "The bus".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PROMPTS_STREAM = "PROMPTS"
TRAJECTORIES_STREAM = "TRAJECTORIES"
WEIGHT_SYNC_STREAM = "WEIGHT_SYNC"
METRICS_STREAM = "METRICS"
WEIGHTS_BUCKET = "WEIGHTS"
REWARD_SUBJECT = "jetrl.reward.score"
REWARD_QUEUE_GROUP = "jetrl-reward"

_RUN_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Headers of a trajectory message.
HDR_MSG_ID = "Nats-Msg-Id"
HDR_STATUS = "Jetrl-Status"
HDR_HEAD_VERSION = "Jetrl-Head-Version"
HDR_TAIL_VERSION = "Jetrl-Tail-Version"
HDR_PROMPT_ID = "Jetrl-Prompt-Id"
STATUS_REJECTED = "rejected"


def check_run(run: str) -> str:
    """Return `run` if it can be a subject token, else raise naming the rule."""
    if not _RUN_RE.match(run):
        raise ValueError(f"run name {run!r} must match {_RUN_RE.pattern} (it becomes a NATS subject token)")
    return run


@dataclass(frozen=True)
class Subjects:
    """Every subject and consumer name of one run."""

    run: str

    def __post_init__(self) -> None:
        check_run(self.run)

    @property
    def prompts_train(self) -> str:
        return f"jetrl.{self.run}.prompts.train"

    @property
    def prompts_eval(self) -> str:
        return f"jetrl.{self.run}.prompts.eval"

    @property
    def prompts_all(self) -> str:
        return f"jetrl.{self.run}.prompts.>"

    @property
    def trajectories(self) -> str:
        """Training trajectories; the trainer's consumer filters on this subject exactly."""
        return f"jetrl.{self.run}.trajectories"

    @property
    def trajectories_eval(self) -> str:
        return f"jetrl.{self.run}.trajectories.eval"

    @property
    def weights_published(self) -> str:
        return f"jetrl.{self.run}.weights.published"

    def weights_loaded(self, server: str) -> str:
        """One subject per server, so the stream keeps each server's last report."""
        return f"jetrl.{self.run}.weights.loaded.{_token(server)}"

    @property
    def weights_loaded_all(self) -> str:
        return f"jetrl.{self.run}.weights.loaded.>"

    def weights_failed(self, server: str) -> str:
        return f"jetrl.{self.run}.weights.failed.{_token(server)}"

    def metrics(self, service: str) -> str:
        return f"jetrl.{self.run}.metrics.{_token(service)}"

    @property
    def metrics_all(self) -> str:
        return f"jetrl.{self.run}.metrics.>"

    @property
    def rollout_consumer(self) -> str:
        """The one durable pull consumer that all rollout workers of the run share."""
        return f"rollout-{self.run}"

    @property
    def trainer_consumer(self) -> str:
        return f"trainer-{self.run}"

    @property
    def eval_consumer(self) -> str:
        return f"eval-{self.run}"

    def weights_object(self, version: int, name: str) -> str:
        return f"{self.run}/v{version}/{name}"


def _token(name: str) -> str:
    """Make a name safe as one subject token (servers are URLs: 'http://127.0.0.1:30000')."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


@dataclass(frozen=True)
class StreamSpec:
    """What `declare_streams` asks the server for. Sizes in bytes; ages in seconds (0 = forever)."""

    name: str
    subjects: tuple[str, ...]
    retention: str  # "workqueue" | "limits"
    max_msgs_per_subject: int = -1
    max_age_s: float = 0.0
    max_bytes: int = -1
    discard: str = "old"
    """At `max_bytes` (or an age cap): "old" drops the oldest messages, "new" refuses new ones."""
    max_msg_size: int = 16 * 1024 * 1024
    duplicate_window_s: float = 120.0


def stream_specs(
    trajectories_max_bytes: int = -1,
    trajectories_max_age_s: float = 0.0,
    metrics_max_age_s: float = 7 * 24 * 3600.0,
    trajectories_discard: str = "old",
) -> list[StreamSpec]:
    """The streams of docs/design.md "The bus". Trajectories are the recording: kept by default."""
    return [
        StreamSpec(PROMPTS_STREAM, ("jetrl.*.prompts.>",), "workqueue", max_msg_size=1024 * 1024),
        StreamSpec(
            TRAJECTORIES_STREAM,
            ("jetrl.*.trajectories", "jetrl.*.trajectories.>"),
            "limits",
            max_bytes=trajectories_max_bytes,
            max_age_s=trajectories_max_age_s,
            discard=trajectories_discard,
            duplicate_window_s=600.0,
        ),
        StreamSpec(WEIGHT_SYNC_STREAM, ("jetrl.*.weights.>",), "limits", max_msgs_per_subject=1),
        StreamSpec(METRICS_STREAM, ("jetrl.*.metrics.>",), "limits", max_age_s=metrics_max_age_s),
    ]
