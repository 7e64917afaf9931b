"""The `trust.*` settings of every service: the shared keys that prove a prompt or a weights
announcement came from the trainer (or a configured prompt issuer), and the key a client shows an
inference server's admin routes. Each key can be given inline (prefer the environment,
`JETRL_<SERVICE>__TRUST__ANNOUNCE_KEY`) or as a file (`*_file`, a mounted secret); keys are
`SecretStr`, never printed in logs, `--help` or errors. docs/security.md says who needs which."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import httpx
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
    """The inference servers' `api_key`, sent (`Authorization: Bearer ...`) with every request but
    those to admin routes; empty: the servers have none."""
    inference_api_key_file: str = ""
    """File holding `inference_api_key`."""
    inference_admin_api_key: SecretStr = SecretStr("")
    """The inference servers' `admin_api_key`, sent with requests to their admin routes (weight
    updates, pause / continue, abort): the weights agent's and the trainer's (broadcast) business.
    Empty: those requests carry `inference_api_key`."""
    inference_admin_api_key_file: str = ""
    """File holding `inference_admin_api_key`."""

    @model_validator(mode="after")
    def _consistent(self) -> TrustSettings:
        for name in ("announce_key", "prompt_issuer_key", "inference_api_key", "inference_admin_api_key"):
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

    def inference_keys(self) -> tuple[str, str]:
        """(api key, admin api key) this service shows inference servers."""
        return (load_key(self.inference_api_key, self.inference_api_key_file, "trust.inference_api_key").decode(),
                load_key(self.inference_admin_api_key, self.inference_admin_api_key_file, "trust.inference_admin_api_key").decode())


ADMIN_ROUTES = frozenset({
    "/pause_generation", "/continue_generation", "/abort_request", "/update_weights_from_disk",
    "/update_weight_version", "/flush_cache", "/init_weights_update_group", "/update_weights_from_distributed",
    "/destroy_weights_update_group", "/get_weights_by_name", "/update_weights_from_tensor", "/begin_weight_update",
    "/end_weight_update",
})
"""The inference server's admin routes today (SGLang's ADMIN_OPTIONAL ones that jetrl serves or
calls), for the docs: what decides is `is_admin_route`, which holds every route admin that is not
named a serving route, so a route added later is protected without being listed."""
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
"""Always open: probes carry no secret."""
SERVING_ROUTES = frozenset({
    "/generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info", "/v1/models", "/v1/loads",
})
"""Generation and model / server info: what a rollout worker calls (with `api_key` when it is set)."""
SERVING_PREFIXES = ("/v1/",)
"""The OpenAI-compatible API (SGLang's chat and completions): serving, not admin."""


def is_admin_route(path: str) -> bool:
    """Whether `path` is an admin route: anything neither open, nor serving (a weight update, pause,
    abort, cache flush, a weight-update group, and any route added later)."""
    return not path.startswith(OPEN_PREFIXES) and path not in SERVING_ROUTES and not path.startswith(SERVING_PREFIXES)


def bearer_for(path: str, api_key: str, admin_api_key: str) -> dict[str, str]:
    """The header a client sends with a request to `path`: an admin route gets the admin key (or
    else the API key), any other route the API key; nothing when no key is configured."""
    key = (admin_api_key or api_key) if is_admin_route(path) else api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


class InferenceAuth(httpx.Auth):
    """httpx authentication that shows an inference server the key each route wants (`bearer_for`)."""

    def __init__(self, api_key: str, admin_api_key: str) -> None:
        self.keys = (api_key, admin_api_key)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers.update(bearer_for(request.url.path, *self.keys))
        yield request
