"""Headers of trajectory messages (docs/design.md "A trajectory message")."""

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
