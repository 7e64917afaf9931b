"""Least privilege on the bus: one NATS user per service, allowed only the subjects it needs.

The allow lists are derived from `schemas.subjects` (so a renamed subject moves the permission with
it) plus the JetStream API subjects each service's client calls make (nats-py: `$JS.API.<verb>.<stream>`
requests, `$JS.ACK.<stream>.<consumer>.>` acknowledgements, replies on the user's own `_INBOX.<user>.>`). `jetrl bus
permissions` prints them as a nats-server `authorization { users = [...] }` block; infra/nats-users.conf
is that block for every run (`run="*"`) and a test keeps the two equal.

Streams and the WEIGHTS bucket are created by the `admin` user (`jetrl bus init`); no other user may
create, update or delete a stream. A service may create and delete only its own named consumers (the
trainer positions its consumer from its checkpoint; the rollout workers' shared consumer carries their
delivery settings) and ephemeral (ordered) consumers of the streams it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.subjects import (
    METRICS_STREAM,
    PROMPTS_STREAM,
    REWARD_SUBJECT,
    TRAJECTORIES_STREAM,
    WEIGHT_SYNC_STREAM,
    WEIGHTS_BUCKET,
    Subjects,
    check_run,
    stream_specs,
)
from services.common.nats_auth import inbox_prefix

API = "$JS.API"
REWARD_SERVICE = "jetrl-reward"
"""The reward's NATS micro-service name (`services.reward.service.SERVICE_NAME`)."""
OBJ_STREAM = f"OBJ_{WEIGHTS_BUCKET}"
ANY_RUN = "*"
ADMIN = "admin"


@dataclass(frozen=True)
class Permissions:
    """What one NATS user may publish and subscribe to; `responses`: it may answer requests it
    received (NATS `allow_responses`), whatever their reply subject."""

    user: str
    doc: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responses: bool = False


class _Run:
    """Subjects and consumer names of one run, or of every run (`*`, a wildcard subject token)."""

    def __init__(self, run: str) -> None:
        self.any = run == ANY_RUN
        self.s = Subjects("RUN" if self.any else check_run(run))
        self.run = run

    def subj(self, subject: str) -> str:
        return subject.replace("jetrl.RUN.", "jetrl.*.", 1) if self.any else subject

    def consumer(self, name: str) -> str:
        """A consumer name as one subject token: a wildcard when the run is."""
        return "*" if self.any else name

    def metrics(self, *services: str) -> list[str]:
        return [self.subj(self.s.metrics(s)) for s in services]


def _stream_info(*streams: str) -> list[str]:
    return [f"{API}.STREAM.INFO.{s}" for s in streams]


def _own_consumer(stream: str, name: str, *, delete: bool = False) -> list[str]:
    """Create (either API form), look up, pull from and acknowledge one durable consumer (and delete
    it: the trainer recreates its own at its checkpoint's position)."""
    return [
        f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{name}",
        f"{API}.CONSUMER.CREATE.{stream}.{name}",
        f"{API}.CONSUMER.CREATE.{stream}.{name}.>",
        f"{API}.CONSUMER.INFO.{stream}.{name}",
        *([f"{API}.CONSUMER.DELETE.{stream}.{name}"] if delete else []),
        f"{API}.CONSUMER.MSG.NEXT.{stream}.{name}",
        f"$JS.ACK.{stream}.{name}.>",
    ]


def _ordered(stream: str) -> list[str]:
    """An ephemeral ordered consumer (nats-py's `subscribe(ordered_consumer=True)`): created unnamed,
    delivering to the client's inbox, answering the server's flow control."""
    return [f"{API}.CONSUMER.CREATE.{stream}", f"$JS.FC.{stream}.>"]


def _inbox(user: str) -> str:
    """Replies to this user's own requests (JetStream API, reward, pulls) and nobody else's: every
    service connects with `nats_auth.inbox_prefix` = `_INBOX.<user>` (the default when `user` is set)."""
    return f"{inbox_prefix(user)}.>"


def _micro(name: str) -> list[str]:
    """The discovery subjects a NATS micro-service answers (`nats micro`, readiness pings)."""
    return [f"$SRV.{verb}{tail}" for verb in ("PING", "INFO", "STATS") for tail in ("", f".{name}", f".{name}.*")]


ALL_STREAMS = tuple(spec.name for spec in stream_specs())
OBJ_READ = [  # the agent's chunk reader: a named pull consumer per fetch, filtered on chunks
    *_stream_info(OBJ_STREAM),
    f"{API}.STREAM.MSG.GET.{OBJ_STREAM}",
    f"{API}.DIRECT.GET.{OBJ_STREAM}.>",
    f"{API}.CONSUMER.CREATE.{OBJ_STREAM}.*.$O.{WEIGHTS_BUCKET}.C.*",
    f"{API}.CONSUMER.DELETE.{OBJ_STREAM}.*",
    f"{API}.CONSUMER.MSG.NEXT.{OBJ_STREAM}.*",
]


def service_permissions(run: str = ANY_RUN) -> list[Permissions]:
    """Every service user's permissions for `run` (`*`: any run on the server)."""
    r = _Run(run)
    s = r.s
    trainer = Permissions(
        "trainer",
        "trainer + prompt feeder + weights publisher: issues prompts, trains trajectories, announces weights",
        publish=(
            r.subj(s.prompts_all),
            r.subj(s.weights_published),
            r.subj(s.weights_loaded_all),  # broadcast members' load reports
            r.subj(f"jetrl.{s.run}.weights.failed.>"),
            *r.metrics("trainer", "eval", "weights_broadcast"),
            f"$O.{WEIGHTS_BUCKET}.>",  # object chunks and their metadata
            *_stream_info(*ALL_STREAMS, OBJ_STREAM),
            f"{API}.STREAM.PURGE.{PROMPTS_STREAM}",  # a fresh run clears its leftover prompts
            f"{API}.STREAM.PURGE.{OBJ_STREAM}",  # old versions and abandoned chunks
            f"{API}.STREAM.MSG.GET.{PROMPTS_STREAM}",
            f"{API}.STREAM.MSG.DELETE.{PROMPTS_STREAM}",  # a prompt given up on is removed
            f"{API}.STREAM.MSG.GET.{WEIGHT_SYNC_STREAM}",
            f"{API}.STREAM.MSG.GET.{OBJ_STREAM}",
            f"{API}.DIRECT.GET.{OBJ_STREAM}.>",
            f"{API}.STREAM.NAMES",  # nats-py's object list finds the stream by subject
            *_ordered(OBJ_STREAM),  # ... and reads the objects' records (old versions are deleted)
            *_own_consumer(TRAJECTORIES_STREAM, r.consumer(s.trainer_consumer), delete=True),
        ),
        subscribe=(
            _inbox("trainer"),
            r.subj(s.trajectories_eval),
            f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{PROMPTS_STREAM}.{r.consumer(s.rollout_consumer)}",
        ),
    )
    rollout = Permissions(
        "rollout",
        "rollout workers: pull prompts, ask the reward, publish trajectories",
        publish=(
            r.subj(s.trajectories),
            r.subj(s.trajectories_eval),
            REWARD_SUBJECT,
            f"$SRV.PING.{REWARD_SERVICE}",  # the readiness check: is a reward service answering?
            *r.metrics("rollout"),
            *_stream_info(*ALL_STREAMS),
            *_own_consumer(PROMPTS_STREAM, r.consumer(s.rollout_consumer)),
        ),
        subscribe=(_inbox("rollout"), r.subj(s.weights_loaded_all)),
    )
    reward = Permissions(
        "reward",
        "reward service: answers requests on the reward subject, nothing else but its metrics",
        publish=(*r.metrics("reward"), *_stream_info(*ALL_STREAMS)),
        subscribe=(_inbox("reward"), REWARD_SUBJECT, *_micro(REWARD_SERVICE)),
        responses=True,
    )
    weights = Permissions(
        "weights",
        "weights agent: reads announcements and the WEIGHTS bucket, reports loads and failures",
        publish=(
            r.subj(f"jetrl.{s.run}.weights.loaded.*"),
            r.subj(f"jetrl.{s.run}.weights.failed.*"),
            *r.metrics("weights"),
            *_stream_info(*ALL_STREAMS),
            f"{API}.STREAM.MSG.GET.{WEIGHT_SYNC_STREAM}",
            *_ordered(WEIGHT_SYNC_STREAM),
            *OBJ_READ,
        ),
        subscribe=(_inbox("weights"),),
    )
    track = Permissions(
        "track",
        "experiment tracker: reads the METRICS stream, publishes nothing",
        publish=(*_stream_info(*ALL_STREAMS), *_ordered(METRICS_STREAM)),
        subscribe=(_inbox("track"),),
    )
    prompts = Permissions(
        "prompts",
        "`jetrl prompts push`: puts prompts on the run's work queue",
        publish=(r.subj(s.prompts_all), *_stream_info(*ALL_STREAMS)),
        subscribe=(_inbox("prompts"),),
    )
    # The observer's consumers: on streams that hold no durable consumer of jetrl's, so creating one
    # by name can never touch (update) the trainer's or the rollout workers'.
    watched = (METRICS_STREAM, WEIGHT_SYNC_STREAM)
    observer = Permissions(
        "observer",
        "`jetrl status`, `jetrl plot`, `jetrl up`'s monitor: reads streams and consumer state, changes nothing",
        publish=(
            *_stream_info(*ALL_STREAMS, OBJ_STREAM),
            f"{API}.INFO",  # the store's use (`jetrl status`)
            *[f"{API}.CONSUMER.INFO.{st}.*" for st in ALL_STREAMS],
            *[f"{API}.STREAM.MSG.GET.{st}" for st in ALL_STREAMS],
            *[x for st in watched for x in (*_ordered(st), f"{API}.CONSUMER.CREATE.{st}.*.>",
                                             f"{API}.CONSUMER.MSG.NEXT.{st}.*")],
        ),
        subscribe=(_inbox("observer"), r.subj(s.metrics_all), r.subj(s.weights_loaded_all)),
    )
    return [trainer, rollout, reward, weights, track, prompts, observer]


def users() -> list[str]:
    """Every user of the config: `admin` (no restrictions: `jetrl bus init`) and one per service."""
    return [ADMIN, *(p.user for p in service_permissions())]


def password_env(user: str) -> str:
    """The environment variable the server reads a user's password from (never written in the file)."""
    return f"JETRL_NATS_PASSWORD_{user.upper()}"


def _quote(items: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


def _string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def passwords_conf(passwords: dict[str, str]) -> str:
    """nats-server variable definitions of every user's password: the file `passwords_include` names."""
    return "".join(f"{password_env(user)}: {_string(pw)}\n" for user, pw in passwords.items())


def authorization_block(run: str = ANY_RUN, passwords: dict[str, str] | None = None, passwords_include: str = "") -> str:
    """The nats-server `authorization` block. A user's password is the variable `password_env(user)`:
    defined in the file `passwords_include` (included inside the block: nats-server does not carry
    variables across includes; a path relative to this file), else read by nats-server from its
    environment, so this file holds no secret. With `passwords`, the given values instead (tests)."""

    def pw(user: str) -> str:
        return f"${password_env(user)}" if passwords is None else _string(passwords[user])

    how = f"--run '{run}'" + (f" --passwords-include {passwords_include}" if passwords_include and passwords is None else "")
    lines = [
        f"# Generated by `jetrl bus permissions {how}`: one NATS user per jetrl service (docs/security.md).",
        "# Streams, the WEIGHTS bucket and their replicas are created by `admin` (`jetrl bus init`).",
        "authorization {",
    ]
    if passwords_include and passwords is None:
        lines.append(f"  # the passwords ({password_env('<USER>')}), from `jetrl bus secrets DIR`")
        lines.append(f"  include {_string(passwords_include)}")
    lines += [
        "  users = [",
        f"    # {ADMIN}: `jetrl bus init` (declares streams and buckets); no restriction",
        f"    {{user: {ADMIN}, password: {pw(ADMIN)}}}",
    ]
    for p in service_permissions(run):
        lines.append(f"    # {p.user}: {p.doc}")
        lines.append(f"    {{user: {p.user}, password: {pw(p.user)}, permissions: {{")
        lines.append(f"      publish: {{allow: {_quote(p.publish)}}}")
        lines.append(f"      subscribe: {{allow: {_quote(p.subscribe)}}}")
        if p.responses:
            lines.append("      allow_responses: true")
        lines.append("    }}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"
