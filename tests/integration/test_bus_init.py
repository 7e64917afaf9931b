"""`jetrl bus init` as the admin declares the bus once (idempotent; a changed cap updates the stream);
a service with `bus_declare=false` only looks streams and the WEIGHTS bucket up, and one started
before `jetrl bus init` fails at once naming it; a restricted user cannot run `bus init`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.subjects import TRAJECTORIES_STREAM, WEIGHTS_BUCKET, stream_specs
from services.bus.nats_server import NatsServer, find_binary
from services.bus.permissions import authorization_block, password_env
from services.bus.secrets import new_password
from services.common.bus import BusNotInitialized, connect, declare_streams
from services.common.busretry import RetryPolicy
from services.common.nats_auth import NatsAuth
from services.weights.objstore import open_bucket
from tests.support.bus_users import ROOT, write_secrets

RUN = "init"


def jetrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)


@pytest.fixture
def secured(tmp_path: Path):
    passwords, files = write_secrets(tmp_path / "secrets")
    server = NatsServer(tmp_path / "nats", extra_conf=authorization_block(RUN, passwords)).start()
    try:
        yield server, files
    finally:
        server.stop()


def as_user(files: dict[str, str], user: str) -> list[str]:
    return [f"nats_auth.user={user}", f"nats_auth.password_file={files[user]}", "connect_timeout_s=10"]


def test_bus_init_declares_once_and_updates_a_changed_cap(secured: tuple[NatsServer, dict[str, str]]) -> None:
    server, files = secured
    first = jetrl("bus", "init", f"nats_url={server.url}", *as_user(files, "admin"))
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.splitlines() == [*(f"{s.name}: created" for s in stream_specs()), f"bucket {WEIGHTS_BUCKET}: created"]
    again = jetrl("bus", "init", f"nats_url={server.url}", *as_user(files, "admin"))
    assert again.stdout.splitlines() == [*(f"{s.name}: unchanged" for s in stream_specs()), f"bucket {WEIGHTS_BUCKET}: unchanged"]
    capped = jetrl("bus", "init", f"nats_url={server.url}", "trajectories_max_bytes=100000000", "trajectories_discard=new",
                   *as_user(files, "admin"))
    assert f"{TRAJECTORIES_STREAM}: updated" in capped.stdout, capped.stdout + capped.stderr[-2000:]

    async def cap() -> tuple[int, str]:
        nc = await connect(server.url, "check", auth=NatsAuth(user="observer", password_file=files["observer"]))
        try:
            config = (await nc.jetstream().stream_info(TRAJECTORIES_STREAM)).config
            return config.max_bytes or 0, str(getattr(config.discard, "value", config.discard))
        finally:
            await nc.close()

    assert asyncio.run(cap()) == (100_000_000, "new")  # at the cap the recording refuses, losing nothing


def test_a_restricted_user_cannot_run_bus_init(secured: tuple[NatsServer, dict[str, str]]) -> None:
    server, files = secured
    result = jetrl("bus", "init", f"nats_url={server.url}", *as_user(files, "rollout"))
    assert result.returncode == 1
    assert "permissions violation" in result.stderr.lower() + result.stdout.lower()
    assert "run `jetrl bus init` as the admin user" in result.stderr + result.stdout


def test_without_bus_init_a_non_declaring_service_fails_naming_it(secured: tuple[NatsServer, dict[str, str]]) -> None:
    server, files = secured

    async def attempt(user: str) -> list[str]:
        errors = []
        nc = await connect(server.url, "check", auth=NatsAuth(user=user, password_file=files[user]))
        try:
            # as a service with `bus_declare=false` declares: its Bus says so
            for call in (lambda: declare_streams(nc.jetstream(), declare=False),
                         lambda: open_bucket(nc.jetstream(), WEIGHTS_BUCKET, declare=False, policy=RetryPolicy())):
                with pytest.raises(BusNotInitialized) as caught:
                    await call()
                errors.append(str(caught.value))
        finally:
            await nc.close()
        return errors

    errors = asyncio.run(attempt("trainer"))
    assert errors[0].startswith("stream PROMPTS does not exist") and "`jetrl bus init`" in errors[0]
    assert errors[1].startswith(f"object store bucket {WEIGHTS_BUCKET} does not exist") and "`jetrl bus init`" in errors[1]
    # and a whole service, as a user would start it: `jetrl track` exits at once, saying what to run
    tb = server.store_dir.parent / "tb"
    track = jetrl("track", f"run={RUN}", f"nats_url={server.url}", "bus_declare=false", f"tensorboard.log_dir={tb}",
                  *as_user(files, "track"))
    assert track.returncode == 1
    assert "run `jetrl bus init` with the admin user's credentials first" in track.stdout + track.stderr


def test_the_users_block_reads_passwords_from_the_servers_environment(tmp_path: Path) -> None:
    """Without --passwords-include the block names each password as an environment variable of
    nats-server: the file holds no secret, and a user logs in with the password from the environment."""
    passwords, files = write_secrets(tmp_path / "secrets")
    block = authorization_block(RUN)
    assert not any(pw in block for pw in passwords.values())
    env = {password_env(user): pw for user, pw in passwords.items()}
    server = NatsServer(tmp_path / "nats", extra_conf=block, env=env).start()
    try:
        async def login(user: str, password_file: str) -> None:
            nc = await connect(server.url, "login", connect_timeout_s=10, auth=NatsAuth(user=user, password_file=password_file))
            await nc.close()

        asyncio.run(login("trainer", files["trainer"]))
        with pytest.raises(ConnectionRefusedError, match=r"(?i)authorization violation"):
            asyncio.run(login("trainer", files["rollout"]))
    finally:
        server.stop()


def test_generated_passwords_survive_nats_servers_environment_parsing(tmp_path: Path) -> None:
    """nats-server parses an environment variable's value as a config value: 400 passwords as
    `jetrl bus secrets` makes them, each in a variable, all read back as strings (`nats-server -t`).
    With `token_urlsafe` about one in thirty (`-abc`, `12345`, `1-2`) stopped the server starting."""
    env = {f"JETRL_PW_{i}": new_password() for i in range(400)}
    users_conf = ", ".join(f"{{user: u{i}, password: ${name}}}" for i, name in enumerate(env))
    conf = tmp_path / "users.conf"
    conf.write_text(f"authorization {{ users = [{users_conf}] }}\n")
    checked = subprocess.run([find_binary(), "-c", str(conf), "-t"], env={**os.environ, **env},
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr[-2000:]


def test_bus_secrets_keeps_existing_passwords_and_prints_none(tmp_path: Path) -> None:
    first = jetrl("bus", "secrets", str(tmp_path / "s"))
    assert first.returncode == 0, first.stderr
    admin = (tmp_path / "s" / "admin").read_text()
    keys = {name: (tmp_path / "s" / name).read_text() for name in ("announce-key", "inference-admin-key")}
    assert all(len(k.strip()) >= 24 for k in keys.values()) and len(set(keys.values())) == 2
    again = jetrl("bus", "secrets", str(tmp_path / "s"))
    assert (tmp_path / "s" / "admin").read_text() == admin, "a re-run changed a password"
    assert {name: (tmp_path / "s" / name).read_text() for name in keys} == keys, "a re-run changed a trust key"
    assert not any(k.strip() in first.stdout + again.stdout + first.stderr for k in [admin, *keys.values()])
    conf = (tmp_path / "s" / "nats-passwords.conf").read_text()
    assert f'{password_env("admin")}: "{admin.strip()}"' in conf
    assert (tmp_path / "s" / ".gitignore").read_text().splitlines()[-1] == "*"


def test_prompts_push_runs_as_the_prompts_user_and_no_other(secured: tuple[NatsServer, dict[str, str]], tmp_path: Path) -> None:
    """`jetrl prompts push` on a bus with per-service users: as `prompts` (after `bus init`) the rows
    land on the work queue; as `rollout`, which may not issue prompts, the server refuses it."""
    server, files = secured
    assert jetrl("bus", "init", f"nats_url={server.url}", *as_user(files, "admin")).returncode == 0
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}{i}{i}=", "answer": "{i}{i}{i}"}}\n' for i in range(3)))

    def push(user: str) -> subprocess.CompletedProcess[str]:
        return jetrl("prompts", "push", str(data), "--nats-url", server.url, "--run", RUN,
                     f"nats_auth.user={user}", f"nats_auth.password_file={files[user]}", "bus_declare=false")

    ok = push("prompts")
    assert ok.returncode == 0, ok.stderr[-2000:]
    refused = push("rollout")
    said = (refused.stdout + refused.stderr).lower()
    assert refused.returncode == 1 and "permissions violation" in said and "did not acknowledge" in said, said[-2000:]

    async def queued() -> int:
        nc = await connect(server.url, "check", auth=NatsAuth(user="observer", password_file=files["observer"]))
        try:
            info = await nc.jetstream().stream_info("PROMPTS")
            return info.state.messages
        finally:
            await nc.close()

    assert asyncio.run(queued()) == 3
    assert files["prompts"] and Path(files["prompts"]).read_text().strip() not in ok.stdout + ok.stderr
