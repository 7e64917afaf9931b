"""The run's credentials: `jetrl up` locks its embedded bus and its inference servers' admin routes
per run, as it signs announcements with a key of the run's own (trust.py).

In `<run_dir>/secrets/` (0700, each file 0600, kept on a resumed run): a random password per NATS
user (`admin` and one per service, services/common/permissions.py), the run name the users block is
for, the inference servers' admin key and the trainer's prompt issuer key. nats-server gets the
users block of this run (only its subjects), which includes the passwords from
`secrets/nats-passwords.conf` (services/runs.py); each service gets only its own user's password
file (and `bus_declare=false`: `up` declares the streams and the bucket as the admin first), the
trainer and the weights agents the admin key. `jetrl status`, `plot`, `track` and `prompts push`
find their user's file here by themselves (and `prompts push` the trainer's prompt issuer key)
(services/runs.py). docs/security.md, "jetrl up".
"""

from __future__ import annotations

import os
import secrets
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.bus.secrets import new_password
from services.common.nats_auth import NatsAuth
from services.common.nats_server import NatsServer
from services.common.permissions import ADMIN, users
from services.runs import PROMPT_ISSUER_KEY, RUN_FILE, SECRETS_DIR, locked_server

INFERENCE_ADMIN_KEY = "inference-admin-key"
ISSUER_KEY_ENV = "JETRL_TRAINER__TRUST__PROMPT_ISSUER_KEY"
"""A prompt issuer key in `jetrl up`'s own environment (or `..._FILE`): taken as the run's (`adopt_issuer_key`)."""
SERVICE_USERS = {"trainer": "trainer", "rollout": "rollout", "reward": "reward", "weights": "weights", "track": "track"}
"""The NATS user each service of the stack runs as (the inference server uses no NATS)."""


def _private(path: Path, make: Any) -> Path:
    """`path` holding a fresh secret (mode 0600 from its creation) unless it holds one already."""
    if not path.exists() or not path.read_text().strip():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(make() + "\n")
    return path


@dataclass(frozen=True)
class RunCredentials:
    dir: Path
    locked: bool
    """Whether the bus admits the run's users only (false: `open_bus`)."""

    @property
    def admin_key_file(self) -> Path:
        return self.dir / INFERENCE_ADMIN_KEY

    def auth(self, user: str) -> NatsAuth:
        return NatsAuth(user=user, password_file=str(self.dir / user))

    def nats_server(self, store: Path, log_file: Path) -> NatsServer:
        if not self.locked:
            return NatsServer(store, log_file=log_file)
        return locked_server(store, log_file, self.dir)

    def section(self, service: str, config: dict[str, Any]) -> dict[str, Any]:
        """What `service`'s settings get: its NATS user (a locked bus) and the admin key (inference:
        the key it wants; trainer and weights agents: the key they show), except what its `config`
        section sets itself (its own credentials or keys win)."""
        out: dict[str, Any] = {}
        user = SERVICE_USERS.get(service)
        if self.locked and user and not config.get("nats_auth"):
            out |= {"nats_auth": {"user": user, "password_file": str(self.dir / user)}, "bus_declare": False}
        trust = config.get("trust") or {}
        if service == "inference" and not (config.get("admin_api_key") or config.get("admin_api_key_file")):
            out["admin_api_key_file"] = str(self.admin_key_file)
        elif service in ("trainer", "weights") and not (trust.get("inference_admin_api_key") or trust.get("inference_admin_api_key_file")):
            out["trust"] = {"inference_admin_api_key_file": str(self.admin_key_file)}
        if service == "trainer" and not (trust.get("prompt_issuer_key") or trust.get("prompt_issuer_key_file")):
            out.setdefault("trust", {})["prompt_issuer_key_file"] = str(self.dir / PROMPT_ISSUER_KEY)
        return out


def make_credentials(run_dir: Path, run: str, *, locked: bool = True) -> RunCredentials:
    """Create (or keep) the run's secrets under `run_dir/secrets`."""
    root = run_dir / SECRETS_DIR
    root.mkdir(mode=0o700, exist_ok=True)
    os.chmod(root, 0o700)
    if locked:
        for user in users():
            _private(root / user, new_password)
        (root / RUN_FILE).unlink(missing_ok=True)
        _private(root / RUN_FILE, lambda: run)
    for key in (INFERENCE_ADMIN_KEY, PROMPT_ISSUER_KEY):
        _private(root / key, lambda: secrets.token_urlsafe(32))
    return RunCredentials(root, locked)


def adopt_issuer_key(creds: RunCredentials, environ: MutableMapping[str, str]) -> str | None:
    """A prompt issuer key the user set for the trainer in `jetrl up`'s environment
    (`JETRL_TRAINER__TRUST__PROMPT_ISSUER_KEY`, or `..._FILE` naming a file of theirs, only read)
    becomes the run's: written (0600) as `secrets/prompt-issuer-key`, the file `up` hands its trainer
    and `jetrl prompts push --run` finds, and taken out of up's own environment (with both, the
    trainer's settings would refuse "set one, not both"). Returns the variable used, None: none set."""
    for var in (ISSUER_KEY_ENV, f"{ISSUER_KEY_ENV}_FILE"):
        value = environ.pop(var, "").strip()
        if not value:
            continue
        key = Path(value).read_text().strip() if var.endswith("_FILE") else value
        if not key:
            raise ValueError(f"{var}: {value} is empty")
        path = creds.dir / PROMPT_ISSUER_KEY
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        for other in (ISSUER_KEY_ENV, f"{ISSUER_KEY_ENV}_FILE"):  # the other one too: one key for the run
            environ.pop(other, None)
        return var
    return None


async def declare_as_admin(url: str, admin: NatsAuth, replicas: int, **caps: Any) -> None:
    """`jetrl bus init` for the run: every stream and the WEIGHTS bucket, as the admin user (`caps`:
    `jetrl bus init`'s size settings, e.g. `trajectories_max_bytes`)."""
    from services.bus.init import init_bus
    from services.bus.settings import BusSettings

    await init_bus(BusSettings(nats_url=url, nats_auth=admin, nats_replicas=replicas, **caps))


__all__ = ["ADMIN", "INFERENCE_ADMIN_KEY", "ISSUER_KEY_ENV", "RunCredentials", "adopt_issuer_key", "declare_as_admin",
           "make_credentials"]
