"""NATS users as the security tests make them: a password per user in its own file, a service
section running as one of them, `jetrl bus init` as the admin, and a test PKI for TLS."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import nats

from services.bus.permissions import ADMIN, users
from services.bus.secrets import new_password

ROOT = Path(__file__).resolve().parents[2]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by the CA."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=jetrl-test-ca", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who}", cwd=d)
        extra = ["-extfile", "san.cnf"] if who == "server" else []
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{who}.pem", "-days", "2", *extra, cwd=d)
    return {name: d / name for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def write_secrets(root: Path) -> tuple[dict[str, str], dict[str, str]]:
    """A random password per user, each in its own file; returns (passwords, files)."""
    root.mkdir(parents=True, exist_ok=True)
    passwords = {u: new_password() for u in users()}
    files = {}
    for user, pw in passwords.items():
        path = root / user
        path.write_text(pw + "\n")
        files[user] = str(path)
    return passwords, files


def as_user(files: dict[str, str], user: str, ca: Path | None = None) -> dict[str, Any]:
    """A service section running as `user` (over TLS when `ca` is given), declaring nothing."""
    auth = {"user": user, "password_file": files[user], **({"tls_ca_file": str(ca)} if ca else {})}
    return {"nats_auth": auth, "bus_declare": False}


def bus_init(url: str, files: dict[str, str], ca: Path | None = None, run: str = "perm") -> subprocess.CompletedProcess[str]:
    """`jetrl bus init` as the admin user (over TLS when `ca` is given)."""
    tls = [f"nats_auth.tls_ca_file={ca}"] if ca else []
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "bus", "init", f"run={run}", f"nats_url={url}",
         f"nats_auth.user={ADMIN}", f"nats_auth.password_file={files[ADMIN]}", *tls, "connect_timeout_s=10"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )


async def refusal(url: str, user: str, password: str, action: str, subject: str) -> str:
    """Publish to (or subscribe to) `subject` as `user`; the server's error about it, or "" if none came."""
    errors: asyncio.Queue[str] = asyncio.Queue()

    async def error_cb(exc: Exception) -> None:
        errors.put_nowait(str(exc))

    nc = await nats.connect(url, user=user, password=password, error_cb=error_cb, allow_reconnect=False)
    try:
        if action == "publish":
            await nc.publish(subject, b"forged")
        else:
            await nc.subscribe(subject)
        await nc.flush()  # the server has read the command: its -ERR, if any, came before the PONG
        try:
            return await asyncio.wait_for(errors.get(), 5)
        except TimeoutError:
            return ""
    finally:
        await nc.close()
