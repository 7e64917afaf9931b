"""Headers of prompt and trajectory messages (docs/design.md "A trajectory message"): how each is
named for JetStream de-duplication, how a reader finds the prompt id in them, and the prompt's tag
(`HDR_PROMPT_TAG`): the issuer's HMAC over (run, prompt id), which a rollout worker copies from the
prompt onto every message answering it, so the trainer can tell a prompt it issued from a forged one."""

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

HDR_PROMPT_TAG = "Jetrl-Prompt-Tag"
"""The prompt's tag (services/common/signing.py), on a prompt and on each result answering it."""


def msg_id(run: str, prompt_id: str) -> str:
    """The de-duplication id: the same for every delivery attempt of one prompt."""
    return f"{run}/{prompt_id}/result"


def prompt_headers(run: str, prompt_id: str, tag: str = "") -> dict[str, str]:
    """Headers of a prompt on the PROMPTS work queue: its de-duplication id names the prompt, so a
    worker can answer a prompt whose body does not decode (`prompt_id_of`); `tag`: the issuer's."""
    return {HDR_MSG_ID: f"{run}/prompt/{prompt_id}", **_tagged(tag)}


def prompt_tag_of(headers: dict[str, str] | None) -> str:
    """The tag a prompt (or a result) carries; empty if none."""
    return (headers or {}).get(HDR_PROMPT_TAG, "")


def _tagged(tag: str) -> dict[str, str]:
    return {HDR_PROMPT_TAG: tag} if tag else {}


def prompt_id_of(run: str, headers: dict[str, str] | None) -> str | None:
    """The prompt id in a prompt's headers (`prompt_headers`), or None if they do not carry one."""
    prefix = f"{run}/prompt/"
    header = (headers or {}).get(HDR_MSG_ID, "")
    return header[len(prefix) :] if header.startswith(prefix) and len(header) > len(prefix) else None


def trajectory_headers(meta: TrajectoryMeta, tag: str = "") -> dict[str, str]:
    """`tag`: the answered prompt's (`prompt_tag_of` its headers), copied unchanged."""
    return {
        HDR_MSG_ID: msg_id(meta.run, meta.prompt_id),
        HDR_PROMPT_ID: meta.prompt_id,
        HDR_HEAD_VERSION: str(meta.head_version),
        HDR_TAIL_VERSION: str(meta.tail_version),
        **_tagged(tag),
    }


def rejection_headers(run: str, prompt_id: str, tag: str = "") -> dict[str, str]:
    return {HDR_MSG_ID: msg_id(run, prompt_id), HDR_PROMPT_ID: prompt_id, HDR_STATUS: STATUS_REJECTED, **_tagged(tag)}


def is_rejection(headers: dict[str, str] | None) -> bool:
    return headers is not None and headers.get(HDR_STATUS) == STATUS_REJECTED
