"""Headers of prompt and trajectory messages (docs/design.md "A trajectory message"): how each is
named for JetStream de-duplication, and how a reader finds the prompt id in them."""

from __future__ import annotations

from schemas.subjects import (
    HDR_HEAD_VERSION,
    HDR_MSG_ID,
    HDR_PROMPT_ID,
    HDR_STATUS,
    HDR_TAIL_VERSION,
    STATUS_REJECTED,
)
from schemas.trajectory import TrajectoryMeta


def msg_id(run: str, prompt_id: str) -> str:
    """The de-duplication id: the same for every delivery attempt of one prompt."""
    return f"{run}/{prompt_id}/result"


def prompt_headers(run: str, prompt_id: str) -> dict[str, str]:
    """Headers of a prompt on the PROMPTS work queue: its de-duplication id names the prompt, so a
    worker can answer a prompt whose body does not decode (`prompt_id_of`)."""
    return {HDR_MSG_ID: f"{run}/prompt/{prompt_id}"}


def prompt_id_of(run: str, headers: dict[str, str] | None) -> str | None:
    """The prompt id in a prompt's headers (`prompt_headers`), or None if they do not carry one."""
    prefix = f"{run}/prompt/"
    header = (headers or {}).get(HDR_MSG_ID, "")
    return header[len(prefix) :] if header.startswith(prefix) and len(header) > len(prefix) else None


def trajectory_headers(meta: TrajectoryMeta) -> dict[str, str]:
    return {
        HDR_MSG_ID: msg_id(meta.run, meta.prompt_id),
        HDR_PROMPT_ID: meta.prompt_id,
        HDR_HEAD_VERSION: str(meta.head_version),
        HDR_TAIL_VERSION: str(meta.tail_version),
    }


def rejection_headers(run: str, prompt_id: str) -> dict[str, str]:
    return {HDR_MSG_ID: msg_id(run, prompt_id), HDR_PROMPT_ID: prompt_id, HDR_STATUS: STATUS_REJECTED}


def is_rejection(headers: dict[str, str] | None) -> bool:
    return headers is not None and headers.get(HDR_STATUS) == STATUS_REJECTED
