"""`jetrl import`: Parquet written by `jetrl export` -> trajectory messages of `run`, in file order
(to move a recording between clusters, or to share a data set).

Each group is published as the bytes the rollout service would have sent, with its headers and a
`Nats-Msg-Id` of the target run, so importing the same file twice within the stream's duplicate
window stores it once (and the trainer skips prompt ids it already trained on anyway). Publishes are
awaited one by one: the stream order is the file order, which a replay depends on.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.replay.settings import ImportSettings

if TYPE_CHECKING:
    from services.common.bus import Bus


@dataclass
class ImportResult:
    groups: int = 0
    duplicates: int = 0
    first_seq: int = 0
    last_seq: int = 0


async def import_files(js: object, settings: ImportSettings, stopping: asyncio.Event | None = None) -> ImportResult:
    from schemas.headers import msg_id
    from schemas.subjects import HDR_MSG_ID, HDR_PROMPT_ID, TRAJECTORIES_STREAM, Subjects
    from services.common.bus import publish_acked
    from services.common.progress import Progress
    from services.replay.parquet import iter_records

    subjects = Subjects(settings.run)
    result = ImportResult()
    progress = Progress("import", "groups", run=settings.run)
    for record in iter_records(settings.input, settings.range, run=settings.source_run):
        headers = dict(record.headers or {})
        headers[HDR_MSG_ID] = msg_id(settings.run, headers[HDR_PROMPT_ID])
        subject = subjects.trajectories_eval if record.subject.endswith(".eval") else subjects.trajectories
        ack = await publish_acked(js, subject, record.data, timeout_s=30.0, headers=headers, stream=TRAJECTORIES_STREAM)  # type: ignore[arg-type]
        result.groups += 1
        result.duplicates += int(bool(ack.duplicate))
        result.first_seq = result.first_seq or ack.seq
        result.last_seq = ack.seq
        progress.advance(last_seq=ack.seq)
        if stopping is not None and stopping.is_set():
            break
    return result


async def run_import(settings: ImportSettings, bus: Bus) -> None:
    from services.common.logging import get_logger
    from services.common.runner import Supervisor, supervise

    log = get_logger("import")
    nc = await bus.connect(f"jetrl-import-{settings.run}", connect_timeout_s=settings.connect_timeout_s)
    try:
        await bus.declare_streams(nc.jetstream())

        async def main(sup: Supervisor) -> None:
            async def run() -> None:
                try:
                    r = await import_files(nc.jetstream(), settings, sup.stopping)
                    log.info("import done", run=settings.run, groups=r.groups, duplicates=r.duplicates,
                             first_seq=r.first_seq, last_seq=r.last_seq)
                finally:
                    sup.stop()

            sup.spawn("import", run())

        await supervise("import", main, settings.shutdown_timeout_s, retry=bus.retry)
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    from services.common.entry import service_main

    return service_main(
        ImportSettings, "services.replay.import_:run_import", argv,
        "Publish Parquet trajectories written by `jetrl export` (input=[FILE,...]) onto run's trajectory stream.",
    )


if __name__ == "__main__":
    raise SystemExit(main())
