"""Settings loading, one path for every command: defaults < a mapping (a YAML file given as
`--config`, or values built in code) < environment (`JETRL_<SERVICE>__<FIELD>`) < CLI overrides
(`key.sub=value`, and the flags a settings class declares, e.g. `--steps 300`). Unknown keys are
errors, wherever they come from.

Each service declares one `ServiceSettings` subclass next to itself, with a docstring per field (it
becomes `--help`), `extra="forbid"`, and a `service` name that sets its environment prefix. A field
that also has a command-line flag says so itself: `Field(300, json_schema_extra=flag("--steps"))`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, ClassVar, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from schemas.subjects import check_run
from services.common.nats_auth import NatsAuth
from services.common.trust import TrustSettings


class SettingsError(ValueError):
    """Settings that cannot be used; the message names the key and the source."""


class Section(BaseModel):
    """A nested group of settings (a sub-table in YAML, `a.b=...` on the CLI, `A__B` in the env)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class ServiceSettings(BaseSettings):
    """Settings every service has."""

    service: ClassVar[str] = "common"

    model_config = SettingsConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        frozen=True,
        env_nested_delimiter="__",
        case_sensitive=False,
    )

    run: str = "default"
    """Run name: part of every subject, so several runs can share one NATS server."""
    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server URL(s), comma-separated."""
    connect_timeout_s: float = 60.0
    """How long to keep trying the first NATS connection (services do not depend on start order)."""
    log_level: str = "info"
    """debug | info | warning | error."""
    log_format: str = "auto"
    """auto (pretty on a terminal, JSON otherwise) | json | console."""
    shutdown_timeout_s: float = 20.0
    """After SIGTERM, how long draining may take before the service exits anyway."""
    health_port: int = 0
    """Port of the HTTP side port (/healthz, /readyz, /metrics); 0 disables it."""
    health_host: str = "127.0.0.1"
    """Address the side port binds: loopback by default; in a container or pod, its own address (or
    0.0.0.0) so probes and Prometheus reach it."""
    nats_monitor_url: str = ""
    """The nats-server's monitor address (`http://host:8222`): when a write times out, its health
    report tells a full store from an outage, and each stream it cannot write is logged at error
    level (docs/security.md "A full disk"). `jetrl up` sets its own server's. Empty: not asked."""
    nats_auth: NatsAuth = NatsAuth()
    """How this service authenticates to NATS (user/password, token, NKey, .creds, TLS, mutual TLS)."""
    trust: TrustSettings = TrustSettings()
    """Keys that prove where prompts and weights announcements come from, and the inference servers' API key."""
    nats_replicas: int = Field(1, ge=1, le=5)
    """Replicas of every stream (and so of their consumers) and of the WEIGHTS bucket this service
    declares: 1 on a single server (the embedded one), 3 on a cluster."""
    bus_declare: bool = True
    """Create or update the streams and the WEIGHTS bucket at start (the embedded `jetrl up`). False:
    only look them up and fail at start naming `jetrl bus init` if one is missing: for a service
    running as a restricted NATS user (docs/security.md), after the admin ran `jetrl bus init`."""

    @field_validator("run")
    @classmethod
    def _run_is_token(cls, v: str) -> str:
        return check_run(v)

    @classmethod
    def env_prefix(cls) -> str:
        return f"JETRL_{cls.service.upper().replace('-', '_')}__"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Constructor arguments over the environment. `load_settings` layers a file's values under the
        # environment itself, so a class holds no per-load state.
        return (init_settings, _env_source(settings_cls))


def _env_source(settings_cls: type[BaseSettings]) -> EnvSettingsSource:
    prefix = settings_cls.env_prefix() if issubclass(settings_cls, ServiceSettings) else ""
    return EnvSettingsSource(settings_cls, env_prefix=prefix, env_nested_delimiter="__", case_sensitive=False)


def read_yaml(path: str | Path, settings_cls: type[BaseSettings] | None = None) -> dict[str, Any]:
    """Read a config file. A file with a top-level key named after the service uses that section."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError as exc:
        raise SettingsError(f"--config: no such file: {path}") from exc
    except yaml.YAMLError as exc:
        raise SettingsError(f"--config {path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"--config {path}: expected a mapping at the top level")
    service = getattr(settings_cls, "service", None)
    if service and isinstance(data.get(service), dict) and service not in (settings_cls.model_fields if settings_cls else {}):
        return data[service]
    return data


S = TypeVar("S", bound=ServiceSettings)


def flag(name: str, *, bare: str | None = None) -> dict[str, Any]:
    """`Field(..., json_schema_extra=flag("--steps"))`: the command line also takes `--steps N` (or
    `--steps=N`) for this setting. `bare`: the value of the flag given alone (`--resume` is `--resume
    auto`); a bool setting's flag is always given alone and means true (`--follow`)."""
    return {"flag": name, "flag_bare": bare}


@dataclass(frozen=True)
class Flag:
    """A command-line spelling of one setting (declared with `flag` on the field)."""

    name: str
    key: str
    """The setting's dotted key (`range.from_seq`)."""
    bare: str | None
    """The value when given alone; None: a value must follow."""
    switch: bool
    """A bool setting: given alone, never with a value."""
    doc: str


def flags(cls: type[BaseModel], prefix: str = "") -> list[Flag]:
    """Every flag `cls` and its sections declare, in field order."""
    out: list[Flag] = []
    for name, field in cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(flags(ann, prefix=f"{prefix}{name}."))
            continue
        extra = field.json_schema_extra
        if isinstance(extra, dict) and isinstance(extra.get("flag"), str):
            bare = extra.get("flag_bare")
            out.append(Flag(str(extra["flag"]), f"{prefix}{name}", str(bare) if bare is not None else None, ann is bool,
                            (field.description or "").strip()))
    return out


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> `{"a": {"b": 1}, "c": "x"}`; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SettingsError(f"override {pair!r}: expected key=value (e.g. run=demo or trainer.lr=1e-4)")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part.replace("-", "_"), {})
            if not isinstance(node, dict):
                raise SettingsError(f"override {pair!r}: {part} is set both as a value and a section")
        node[parts[-1].replace("-", "_")] = value
    return out


def _unknown_env_keys(cls: type[ServiceSettings]) -> list[str]:
    prefix = cls.env_prefix().lower()
    fields = {name.lower() for name in cls.model_fields}
    unknown = []
    for key in os.environ:
        low = key.lower()
        if low.startswith(prefix):
            top = low[len(prefix) :].split("__", 1)[0]
            if top not in fields:
                unknown.append(key)
    return unknown


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, section by section (a key of `base` that `over` does not name survives)."""
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        out[key] = deep_merge(old, value) if isinstance(value, Mapping) and isinstance(old, Mapping) else value
    return out


def load_settings(cls: type[S], config: str | Path | None = None, overrides: list[str] | None = None, *,
                  values: Mapping[str, Any] | None = None) -> S:
    """Build settings from every source; raise `SettingsError` naming what is wrong.

    Lowest first: the defaults; `values` (a mapping: e.g. one section of a file read by the caller);
    the YAML file `config`; the environment; `overrides` (`key.sub=value`)."""
    unknown = _unknown_env_keys(cls)
    if unknown:
        raise SettingsError(
            f"unknown environment variable(s) {', '.join(sorted(unknown))}: "
            f"{cls.__name__} has no such field (see `jetrl {cls.service} --help`)"
        )
    layered = deep_merge(values or {}, read_yaml(config, cls) if config else {})
    layered = deep_merge(layered, _env_source(cls)())
    layered = deep_merge(layered, parse_overrides(overrides or []))
    try:
        return cls(**layered)
    except ValidationError as exc:
        raise SettingsError(_explain(cls, exc)) from exc


def _explain(cls: type[BaseModel], exc: ValidationError) -> str:
    lines = [f"invalid {cls.__name__} settings:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown key (see `jetrl {getattr(cls, 'service', '')} --help`)")
        else:
            lines.append(f"  {loc}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def describe(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, doc) for every field, nested sections flattened: the body of `--help`. A
    section that is one of several kinds (a discriminated union, e.g. `weights`) lists every kind's
    settings once, each saying which kinds have it."""
    rows: list[tuple[str, str, str]] = []
    for name, field in cls.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(describe(ann, prefix=f"{key}."))
            continue
        kinds = _variants(ann)
        if kinds:
            chosen = getattr(field.get_default(call_default_factory=True), "transport", None)
            rows.extend(_describe_kinds(kinds, f"{key}.", repr(chosen), (field.description or "").strip()))
            continue
        default = "(required)" if field.is_required() else repr(field.get_default(call_default_factory=True))
        rows.append((key, default, (field.description or "").strip()))
    return rows


def _variants(ann: Any) -> list[type[BaseModel]]:
    """The sections of a union of sections (`Annotated` and `Tag`s unwrapped); [] for anything else."""
    while get_origin(ann) is Annotated:
        ann = get_args(ann)[0]
    if get_origin(ann) not in (Union, UnionType):
        return []
    kinds = [get_args(a)[0] if get_origin(a) is Annotated else a for a in get_args(ann)]
    return kinds if all(isinstance(k, type) and issubclass(k, BaseModel) for k in kinds) else []


def _describe_kinds(kinds: list[type[BaseModel]], prefix: str, default: str, doc: str) -> list[tuple[str, str, str]]:
    """The rows of a union of sections told apart by their `transport`: that key first, with the
    section's own doc; then each setting once, naming the kinds that have it."""
    seen: dict[str, tuple[str, str, list[str]]] = {f"{prefix}transport": (default, doc, [])}
    for kind in kinds:
        tag = str(kind.model_fields["transport"].default) if "transport" in kind.model_fields else kind.__name__
        for key, value, text in describe(kind, prefix):
            seen.setdefault(key, (value, text, []))[2].append(tag)
    rows = []
    for key, (value, text, tags) in seen.items():
        where = "" if len(tags) in (0, len(kinds)) else f" [{', '.join(tags)}]"
        rows.append((key, value, f"{text}{where}"))
    return rows


__all__ = [
    "Field",
    "Flag",
    "Section",
    "ServiceSettings",
    "SettingsError",
    "deep_merge",
    "describe",
    "flag",
    "flags",
    "load_settings",
    "parse_overrides",
    "read_yaml",
]
