"""Finding a run's NATS server and credentials from its run directory: `jetrl up` writes
`<run_dir>/nats.url` while it runs, and keeps the run's NATS users' passwords in `<run_dir>/secrets/`
(docs/security.md); after it ends, tools start a private nats-server on the run's own store, with the
same users, to read the recording."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from services.bus.secrets import PASSWORDS_CONF
from services.common.nats_auth import NatsAuth
from services.common.nats_server import NatsServer
from services.common.permissions import authorization_block, passwords_conf, users

URL_FILE = "nats.url"
MONITOR_URL_FILE = "nats-monitor.url"
"""Under a live run's directory: its embedded nats-server's monitor address (`jetrl status` reads its health)."""
SECRETS_DIR = "secrets"
"""Under a run directory: one file per NATS user (its password) and the run's other keys, 0600."""
RUN_FILE = "run"
"""Under SECRETS_DIR: the run name the users block was generated for."""
PROMPT_ISSUER_KEY = "prompt-issuer-key"
"""Under SECRETS_DIR: the run trainer's `trust.prompt_issuer_key` (`jetrl prompts push` tags with it)."""


def run_auth(run_path: Path, user: str) -> NatsAuth | None:
    """The credentials of `user` on the run's bus, when `jetrl up` made them (None: an open bus)."""
    path = Path(run_path) / SECRETS_DIR / user
    return NatsAuth(user=user, password_file=str(path)) if path.is_file() else None


def run_bus(run_path: Path, user: str, nats_url: str, fields_set: set[str]) -> tuple[str, NatsAuth | None]:
    """Where a tool of `user` connects, and as whom: an explicit `nats_url` (in `fields_set`) as
    given; else a live `jetrl up` run's own server, with the run's credentials of `user` unless
    `nats_auth` was given; else `nats_url`. None: the process's own `nats_auth`."""
    url = None if "nats_url" in fields_set else live_url(run_path)
    if url is None:
        return nats_url, None
    return url, None if "nats_auth" in fields_set else run_auth(run_path, user)


def live_url(run_path: Path) -> str | None:
    """The NATS URL of a live `jetrl up` run, else None."""
    path = Path(run_path) / URL_FILE
    return path.read_text().strip() if path.exists() else None


def locked_server(store: Path, log_file: Path, secrets: Path) -> NatsServer:
    """A nats-server on `store` admitting the run's users only (`jetrl up`'s, and the private one
    that reads an ended run's recording): its users block, which includes the passwords from
    `secrets/nats-passwords.conf` (0600). Not from the server's environment: a nats-server restarted
    with the same command line (`nats-server -c <store>/nats-server.conf`, after a crash or a kill)
    must admit the run's services again, and without the variables it would not even start."""
    run = (secrets / RUN_FILE).read_text().strip()
    passwords = Path(secrets) / PASSWORDS_CONF
    fd = os.open(passwords, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(passwords_conf({u: (secrets / u).read_text().strip() for u in users()}))
    os.chmod(passwords, 0o600)
    server = NatsServer(store, log_file=log_file)
    # nats-server reads an include relative to the config's folder (the store), never as an absolute path
    include = os.path.relpath(passwords.resolve(), server.store_dir)
    server.extra_conf = authorization_block(run, passwords_include=include)
    return server


def run_directory(run: str, run_dir: str = "runs") -> Path:
    """`run` may be a run name (under run_dir) or a path to a run directory."""
    path = Path(run)
    if (path / "nats").is_dir() or (path / URL_FILE).exists():
        return path
    return Path(run_dir) / run


@contextlib.contextmanager
def run_nats(run_path: Path, nats_url: str | None = None) -> Iterator[str]:
    """Yield a NATS URL that serves the run's streams: the given one, the live run's, or a private
    server started on the run's store (stopped on exit)."""
    if nats_url:
        yield nats_url
        return
    live = run_path / URL_FILE
    if live.exists():
        yield live.read_text().strip()
        return
    store = run_path / "nats"
    if not store.is_dir():
        raise FileNotFoundError(f"{run_path}: no live run (no {URL_FILE}) and no NATS store ({store}); pass --nats-url")
    log_file = run_path / "nats-readonly.log"
    secrets = run_path / SECRETS_DIR
    server = locked_server(store, log_file, secrets) if (secrets / RUN_FILE).is_file() else NatsServer(store, log_file=log_file)
    with server:
        yield server.url
