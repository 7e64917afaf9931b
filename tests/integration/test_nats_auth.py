"""NATS authentication as settings: a real nats-server with users and with mutual TLS (certificates
made by the test with openssl). The right credentials connect; wrong ones fail in seconds with the
server's own error named, not after the connect timeout; a service process takes them from its
settings (a password file) and never prints the secret."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.bus.nats_server import NatsServer
from services.common.bus import connect
from services.common.nats_auth import NatsAuth
from tests.support.bus_users import make_pki

REPO = Path(__file__).resolve().parents[2]
USERS = """
authorization {
  users = [
    {user: trainer, password: s3cret-trainer}
    {user: rollout, password: s3cret-rollout}
  ]
}
"""


@pytest.fixture
def users_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats", extra_conf=USERS).start()
    try:
        yield server
    finally:
        server.stop()


async def test_user_and_password_connect_and_a_wrong_password_fails_fast_naming_the_error(users_server: NatsServer) -> None:
    nc = await connect(users_server.url, "ok", auth=NatsAuth(user="trainer", password="s3cret-trainer"))
    await nc.publish("jetrl.check", b"x")
    await nc.close()
    started = time.monotonic()
    with pytest.raises(ConnectionRefusedError, match=r"(?i)authorization violation") as info:
        await connect(users_server.url, "bad", connect_timeout_s=60, auth=NatsAuth(user="trainer", password="wrong"))
    assert time.monotonic() - started < 5, "a refused login waited for the connect timeout"
    assert "wrong" not in str(info.value)
    with pytest.raises(ConnectionRefusedError):
        await connect(users_server.url, "anonymous", connect_timeout_s=60)


async def test_mutual_tls_needs_the_client_certificate(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    tls = f"""
tls {{
  cert_file: "{pki['server.pem']}"
  key_file: "{pki['server.key']}"
  ca_file: "{pki['ca.pem']}"
  verify: true
  timeout: 2
}}
"""
    server = NatsServer(tmp_path / "nats", extra_conf=tls).start()
    try:
        auth = NatsAuth(tls_ca_file=str(pki["ca.pem"]), tls_cert_file=str(pki["client.pem"]), tls_key_file=str(pki["client.key"]))
        nc = await connect(server.url, "mtls", auth=auth)
        js = nc.jetstream()
        await js.add_stream(name="T", subjects=["t.>"])
        assert (await js.publish("t.1", b"x")).seq == 1
        await nc.close()
        started = time.monotonic()
        with pytest.raises(ConnectionError):
            await connect(server.url, "no-cert", connect_timeout_s=60, auth=NatsAuth(tls_ca_file=str(pki["ca.pem"])))
        assert time.monotonic() - started < 10
    finally:
        server.stop()


def test_a_service_takes_credentials_from_its_settings_and_never_prints_them(users_server: NatsServer, tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret-rollout\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JETRL_STATUS__NATS_AUTH__USER": "rollout"}
    ok = subprocess.run(
        [sys.executable, "-m", "services.status", f"nats_url={users_server.url}", f"nats_auth.password_file={secret}",
         "format=json", "run=auth"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    started = time.monotonic()
    bad = subprocess.run(
        [sys.executable, "-m", "services.status", f"nats_url={users_server.url}", "nats_auth.password=hunter2-wrong",
         "format=json", "run=auth", "timeout_s=60"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode != 0
    assert time.monotonic() - started < 30  # the process start included; the login itself fails in seconds
    out = bad.stdout + bad.stderr
    assert "authorization violation" in out.lower(), out[-2000:]
    assert "hunter2-wrong" not in out and "s3cret" not in ok.stdout + ok.stderr
