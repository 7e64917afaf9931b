"""The `trust.*` settings of every service: the shared keys that prove a prompt or a weights
announcement came from the trainer (or a configured prompt issuer), and the key a client shows an
inference server's admin routes. Each key can be given inline (prefer the environment,
`JETRL_<SERVICE>__TRUST__ANNOUNCE_KEY`) or as a file (`*_file`, a mounted secret); keys are
`SecretStr`, never printed in logs, `--help` or errors. docs/security.md says who needs which."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, SecretStr, model_validator

from services.common.signing import load_key


class TrustSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    announce_key: SecretStr = SecretStr("")
    """HMAC key of weights announcements: the trainer signs each `WeightsPublished` with it and a
    weights agent given it refuses an unsigned or wrongly signed one. Empty: not signed, not checked."""
    announce_key_file: str = ""
    """File holding `announce_key`."""
    prompt_issuer_key: SecretStr = SecretStr("")
    """HMAC key of prompts not issued by the trainer's feeder: `jetrl prompts push` tags each prompt
    with it, and the trainer trains a group of such a prompt only if its tag checks out under this key."""
    prompt_issuer_key_file: str = ""
    """File holding `prompt_issuer_key`."""
    inference_api_key: SecretStr = SecretStr("")
    """Bearer token this service sends to inference servers (`Authorization: Bearer ...`): their
    `admin_api_key` for the weights agent (admin routes), their `api_key` for rollout workers."""
    inference_api_key_file: str = ""
    """File holding `inference_api_key`."""

    @model_validator(mode="after")
    def _consistent(self) -> TrustSettings:
        for name in ("announce_key", "prompt_issuer_key", "inference_api_key"):
            path = getattr(self, f"{name}_file")
            if getattr(self, name).get_secret_value() and path:
                raise ValueError(f"trust: set {name} or {name}_file, not both")
            if path and not Path(path).is_file():
                raise ValueError(f"trust.{name}_file: no such file {path}")
        return self

    def announce(self) -> bytes:
        return load_key(self.announce_key, self.announce_key_file, "trust.announce_key")

    def prompt_issuer(self) -> bytes:
        return load_key(self.prompt_issuer_key, self.prompt_issuer_key_file, "trust.prompt_issuer_key")

    def inference_bearer(self) -> str:
        return load_key(self.inference_api_key, self.inference_api_key_file, "trust.inference_api_key").decode()
