"""Settings loading: defaults < YAML file (`--config`) < environment (`JETRL_<SERVICE>__<FIELD>`) <
CLI overrides (`key.sub=value`). Unknown keys are errors, wherever they come from.

Each service declares one `ServiceSettings` subclass next to itself, with a docstring per field (it
becomes `--help`), `extra="forbid"`, and a `service` name that sets its environment prefix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, TypeVar

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
        env = EnvSettingsSource(
            settings_cls, env_prefix=cls.env_prefix(), env_nested_delimiter="__", case_sensitive=False
        )
        yaml_source = _YamlSource(settings_cls, _yaml_path.get(settings_cls))
        return (init_settings, env, yaml_source)


# The YAML path is per-load state; settings classes are frozen, so it travels beside them.
_yaml_path: dict[type, Path | None] = {}


class _YamlSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], path: Path | None) -> None:
        super().__init__(settings_cls)
        self.path = path

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # unused
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        return read_yaml(self.path, self.settings_cls)


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


def load_settings(cls: type[S], config: str | Path | None = None, overrides: list[str] | None = None) -> S:
    """Build settings from every source; raise `SettingsError` naming what is wrong."""
    unknown = _unknown_env_keys(cls)
    if unknown:
        raise SettingsError(
            f"unknown environment variable(s) {', '.join(sorted(unknown))}: "
            f"{cls.__name__} has no such field (see `jetrl {cls.service} --help`)"
        )
    _yaml_path[cls] = Path(config) if config else None
    try:
        return cls(**parse_overrides(overrides or []))
    except ValidationError as exc:
        raise SettingsError(_explain(cls, exc)) from exc
    finally:
        _yaml_path.pop(cls, None)


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
    """(key, default, doc) for every field, nested sections flattened: the body of `--help`."""
    rows: list[tuple[str, str, str]] = []
    for name, field in cls.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(describe(ann, prefix=f"{key}."))
            continue
        default = "(required)" if field.is_required() else repr(field.get_default(call_default_factory=True))
        rows.append((key, default, (field.description or "").strip()))
    return rows


__all__ = [
    "Field",
    "Section",
    "ServiceSettings",
    "SettingsError",
    "describe",
    "load_settings",
    "parse_overrides",
    "read_yaml",
]
