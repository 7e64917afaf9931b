"""A stream's state as its leader holds it, for the calls whose answer decides what is read.

In a cluster, a replica of a stream with no leader (its majority is down, or an election is under
way) answers `STREAM.INFO` itself after a few seconds, from its own copy, which may lack the newest
messages: a node that was behind when the others died reports a last sequence they had passed. The
end of a replay's range and the point a fresh trainer starts reading from are taken from that state,
so a leaderless answer is refused and retried as an outage (`js_api_call`) until a leader answers.
`jetrl plot` bounds its read the same way. `jetrl status` shows a leaderless answer, marked as such;
stream declaration reads only the stream's config, which every node holds.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import StreamInfo

from services.common.bus import js_api_call
from services.common.busretry import NoStreamLeader, RetryPolicy


def led(info: StreamInfo) -> bool:
    """The answer came from the stream's leader (or from a server that is no cluster)."""
    return info.cluster is None or info.cluster.leader is not None


async def leader_stream_info(js: JetStreamContext, stream: str, subjects_filter: str | None = None, *,
                             policy: RetryPolicy) -> StreamInfo:
    """`js.stream_info(stream, subjects_filter)` answered by the stream's leader, waited for through an
    outage within `DECLARE_BUDGET_S` (then `BusUnavailable`); `policy`: the caller's (`Bus.retry`)."""

    async def ask() -> StreamInfo:
        info = await js.stream_info(stream, subjects_filter=subjects_filter)
        if not led(info):
            raise NoStreamLeader(f"stream {stream} has no leader; a replica answered with its own copy "
                                 f"(last sequence {info.state.last_seq}), which may be behind")
        return info

    return await js_api_call(f"stream {stream}: info from its leader", ask, policy=policy)
