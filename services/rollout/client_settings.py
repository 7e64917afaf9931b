"""The settings of the rollout side's SGLang client (`InferenceEngine`): which servers, how a request
picks one, timeouts, retries and failover, batching of `/generate` passes, client-side stop strings."""

from __future__ import annotations

from typing import Literal

from services.common.settings import Section


class InferenceClientSettings(Section):
    servers: list[str] = ["http://127.0.0.1:30000"]  # noqa: RUF012 - a pydantic field, copied per instance
    """Base URLs of the inference servers (or one sglang_router)."""
    policy: Literal["least_loaded", "round_robin"] = "least_loaded"
    """How a new episode picks its server: fewest requests in flight from this client, or in turn."""
    request_timeout_s: float = 600.0
    """Timeout of one /generate pass (a long generation is one pass)."""
    connect_timeout_s: float = 5.0
    """Timeout for opening a connection."""
    control_timeout_s: float = 120.0
    """Timeout of pause / continue / update_weights_from_disk calls (loading can be slow)."""
    max_retries: int = 2
    """Retries on one server (timeouts, connection errors, 408/429/5xx) before failing over."""
    backoff_initial_s: float = 0.2
    """First backoff; doubles each retry, with full jitter."""
    backoff_max_s: float = 5.0
    """Cap of one backoff."""
    down_cooldown_s: float = 10.0
    """A server that failed all its retries is skipped by new choices for this long."""
    max_passes: int = 1000
    """Abort continuations allowed for one request before it is an error (a server stuck aborting)."""
    batch_generate: bool = True
    """Send the `/generate` passes that start together (a group's samples, their continuations after a
    pause) to one server as one batched request (SGLang's list-of-`input_ids` form) instead of one
    request each: far less HTTP and JSON work on both sides. False: one request per pass (for a router
    in front of the servers that refuses the batch form)."""
    batch_max_size: int = 256
    """The most passes one batched `/generate` carries; more that arrive together go in further batches."""
    tokenizer_path: str = ""
    """Tokenizer (HF name or directory) that decodes outputs to apply stop strings client-side; empty:
    the `tokenizer_path` the first server reports in its model info, loaded on the first request with
    stop strings."""
