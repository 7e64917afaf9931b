"""Progress lines: at most one per interval, with the rate, the share done and the time left."""

from __future__ import annotations

from structlog.testing import capture_logs

from services.common.progress import Progress


def test_progress_reports_rate_share_and_time_left_at_most_every_interval() -> None:
    with capture_logs() as logs:
        p = Progress("export", "messages", total=100, every_s=0.0, output="x.parquet")
        for _ in range(4):
            p.advance(25)
        final = p.finish()
    lines = [e for e in logs if e["event"] == "progress"]
    assert [e["messages"] for e in lines] == [25, 50, 75, 100]
    assert lines[1]["percent"] == 50.0 and lines[1]["of"] == 100 and "eta_s" in lines[1]
    assert lines[0]["output"] == "x.parquet"
    assert final["messages"] == 100 and final["percent"] == 100.0
    with capture_logs() as logs:
        quiet = Progress("import", "groups", every_s=3600)
        for _ in range(1000):
            quiet.advance()
    assert not [e for e in logs if e["event"] == "progress"]  # nothing until the interval has passed
    assert "of" not in quiet.figures()  # no total known: no share, no time left
