"""Finding a run's NATS server from its run directory: `jetrl up` writes `<run_dir>/nats.url` while it
runs; after it ends, tools start a private nats-server on the run's own store to read the recording."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from services.common.nats_server import NatsServer

URL_FILE = "nats.url"


def run_directory(run: str, run_dir: str = "runs") -> Path:
    """`run` may be a run name (under run_dir) or a path to a run directory."""
    path = Path(run)
    if (path / "nats").is_dir() or (path / URL_FILE).exists():
        return path
    return Path(run_dir) / run


@contextlib.contextmanager
def run_nats(run_path: Path, nats_url: str | None = None) -> Iterator[str]:
    """Yield a NATS URL that serves the run's streams: the given one, the live run's, or a private
    server started on the run's store (stopped on exit)."""
    if nats_url:
        yield nats_url
        return
    live = run_path / URL_FILE
    if live.exists():
        yield live.read_text().strip()
        return
    store = run_path / "nats"
    if not store.is_dir():
        raise FileNotFoundError(f"{run_path}: no live run (no {URL_FILE}) and no NATS store ({store}); pass --nats-url")
    with NatsServer(store, log_file=run_path / "nats-readonly.log") as server:
        yield server.url
