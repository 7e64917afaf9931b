"""`jetrl export`: a recorded range of a run's trajectory stream -> one Parquet file, one row per
sample (the Arrow columns plus the message metadata; see `parquet.py`).

Rejection markers and groups outside the version range are skipped and counted; a corrupted message
is logged with its sequence, counted and skipped. The file is written under a temporary name and
renamed when complete; SIGTERM stops the read and completes the file with what was read so far (the
log names the last sequence, so `--from-seq` can continue).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from services.replay.settings import ExportSettings

if TYPE_CHECKING:
    from services.common.bus import Bus
    from services.common.busretry import RetryPolicy


@dataclass
class ExportResult:
    path: Path
    groups: int = 0
    rows: int = 0
    last_seq: int = 0
    malformed: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: {"rejection": 0, "version": 0})
    complete: bool = True


async def export_range(js: object, settings: ExportSettings, stopping: asyncio.Event | None = None,
                       retry: RetryPolicy | None = None) -> ExportResult:
    """Write the range of `settings.run` to `settings.output`; returns what was written and skipped
    (`retry`: the service's retry policy, `Bus.retry`)."""
    from schemas.trajectory import TrajectoryError, decode_group
    from services.common.logging import get_logger
    from services.common.progress import Progress
    from services.replay.parquet import ExportWriter, group_rows
    from services.replay.reader import StreamReader
    from services.replay.source import skip_reason

    log = get_logger("export")
    out = Path(settings.output)
    tmp = out.with_name(out.name + ".partial")
    result = ExportResult(out)
    writer = ExportWriter(tmp, settings.row_group_rows, settings.compression)
    reader = StreamReader(js, settings.run, settings.range, batch=settings.fetch_batch, retry=retry)  # type: ignore[arg-type]
    progress: Progress | None = None
    try:
        async for record in reader:
            if progress is None:  # the reader knows the range's end once it has started
                progress = Progress("export", "messages", reader.end_seq - record.seq + 1, output=str(out))
            progress.advance(last_seq=record.seq)
            result.last_seq = record.seq
            reason = skip_reason(record, settings.range)
            if reason is not None:
                result.skipped[reason] += 1
            else:
                try:
                    group = decode_group(record.data)
                except TrajectoryError as exc:
                    result.malformed += 1
                    log.error("corrupted message in the recording skipped", subject=record.subject,
                              stream_seq=record.seq, error=str(exc))
                else:
                    writer.add(group_rows(group, record.seq, record.time))
            if stopping is not None and stopping.is_set():
                result.complete = False
                break
        writer.close()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    if writer.groups:
        tmp.replace(out)
    result.groups, result.rows = writer.groups, writer.rows
    return result


async def run_export(settings: ExportSettings, bus: Bus) -> None:
    from services.common.logging import get_logger
    from services.common.runner import Supervisor, supervise

    log = get_logger("export")
    nc = await bus.connect(f"jetrl-export-{settings.run}", connect_timeout_s=settings.connect_timeout_s)
    try:
        async def main(sup: Supervisor) -> None:
            async def run() -> None:
                try:
                    r = await export_range(nc.jetstream(), settings, sup.stopping, bus.retry)
                    log.info("export written" if r.groups else "export: nothing in the range", path=str(r.path),
                             groups=r.groups, rows=r.rows, last_seq=r.last_seq, malformed=r.malformed,
                             skipped=r.skipped, complete=r.complete)
                finally:
                    sup.stop()

            sup.spawn("export", run())

        await supervise("export", main, settings.shutdown_timeout_s, retry=bus.retry)
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    from services.common.entry import service_main

    return service_main(
        ExportSettings, "services.replay.export:run_export", argv,
        "Write a recorded range of run's trajectory stream (--from-seq/--to-seq or --since/--until) to Parquet "
        "(--output FILE): one row per sample with the message metadata.",
    )


if __name__ == "__main__":
    raise SystemExit(main())
