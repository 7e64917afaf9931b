"""Poison messages: a JetStream message that does not decode is terminated, logged and counted; the
service goes on (docs/design.md "The bus")."""

from __future__ import annotations

from nats.aio.msg import Msg

from services.common.logging import get_logger
from services.common.metrics import MetricsPublisher

log = get_logger("poison")


async def terminate_poison(msg: Msg, error: Exception, metrics: MetricsPublisher | None = None) -> None:
    seq = None
    try:
        seq = msg.metadata.sequence.stream
    except Exception:  # not a JetStream message (no reply subject): nothing to terminate
        pass
    log.error("malformed message terminated", subject=msg.subject, stream_seq=seq, error=str(error))
    if metrics is not None:
        metrics.count("malformed_messages")
    if seq is not None:
        await msg.term()
