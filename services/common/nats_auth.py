"""How a service proves who it is to NATS: user and password, a token, an NKey seed, a `.creds` file
(JWT + seed), and TLS with a CA, a client certificate and key (mutual TLS). A setting section of
every service (`nats_auth.*`); each secret can come from a file (`*_file`, for container secrets) or
from the environment (`JETRL_<SERVICE>__NATS_AUTH__PASSWORD`...). Secrets are `SecretStr`: never
printed in logs, `--help` or errors."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, SecretStr, model_validator


class NatsAuth(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    user: str = ""
    """NATS user name (with `password` or `password_file`)."""
    password: SecretStr = SecretStr("")
    """NATS password; prefer `password_file` or the environment."""
    password_file: str = ""
    """File holding the NATS password (e.g. a mounted secret)."""
    token: SecretStr = SecretStr("")
    """NATS authentication token; prefer `token_file` or the environment."""
    token_file: str = ""
    """File holding the NATS token."""
    nkey_seed_file: str = ""
    """NKey seed file (`SU...`): authenticate with an NKey (needs the `nkeys` package)."""
    creds_file: str = ""
    """A `.creds` file (user JWT + NKey seed) for decentralized (operator/account) auth."""
    tls_ca_file: str = ""
    """CA certificate(s) that sign the server's certificate; set to use TLS (`tls://` URLs)."""
    tls_cert_file: str = ""
    """Client certificate for mutual TLS (with `tls_key_file`)."""
    tls_key_file: str = ""
    """Client private key for mutual TLS."""
    tls_hostname: str = ""
    """Server name to verify the server's certificate against, when it differs from the URL's host."""
    inbox_prefix: str = ""
    """Prefix of this client's reply subjects (JetStream API answers, pulled messages, reward replies).
    Default: `_INBOX.<user>` when `user` is set, which is all `jetrl bus permissions` lets that user
    subscribe to, so no service can read another's replies; else nats-py's `_INBOX`."""

    @model_validator(mode="after")
    def _consistent(self) -> NatsAuth:
        if self.password.get_secret_value() and self.password_file:
            raise ValueError("nats_auth: set password or password_file, not both")
        if self.token.get_secret_value() and self.token_file:
            raise ValueError("nats_auth: set token or token_file, not both")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("nats_auth: mutual TLS needs both tls_cert_file and tls_key_file")
        for name in ("password_file", "token_file", "nkey_seed_file", "creds_file", "tls_ca_file", "tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"nats_auth.{name}: no such file {path}")
        return self

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_ca_file or self.tls_cert_file)

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments of `nats.connect` for these credentials (none when nothing is set)."""
        opts: dict[str, Any] = {}
        password = _secret(self.password, self.password_file)
        if self.user:
            opts["user"] = self.user
            opts["password"] = password
        prefix = self.inbox_prefix or (inbox_prefix(self.user) if self.user else "")
        if prefix:
            opts["inbox_prefix"] = prefix
        token = _secret(self.token, self.token_file)
        if token:
            opts["token"] = token
        if self.nkey_seed_file:
            opts["nkeys_seed"] = self.nkey_seed_file
        if self.creds_file:
            opts["user_credentials"] = self.creds_file
        if self.uses_tls:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca_file or None)
            if self.tls_cert_file:
                ctx.load_cert_chain(self.tls_cert_file, self.tls_key_file)
            opts["tls"] = ctx
            if self.tls_hostname:
                opts["tls_hostname"] = self.tls_hostname
        return opts


def inbox_prefix(user: str) -> str:
    """The reply-subject prefix of `user`: the users block allows it `<prefix>.>` and nothing wider."""
    return f"_INBOX.{user}"


def _secret(value: SecretStr, path: str) -> str:
    if path:
        return Path(path).read_text().strip()
    return value.get_secret_value()
