"""Shared fixtures: a real nats-server per test on a free port with a temp store (ready-checked on its
/healthz, never by sleeping), a connection to it with jetrl's streams declared, and the tiny model
built once per session."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every test trainer trusts this prompt issuer: tests/support/trainer.py tags the groups it publishes
# with it, as `jetrl prompts push --issuer-key-file` would tag pushed prompts (docs/security.md).
os.environ.setdefault("JETRL_TRAINER__TRUST__PROMPT_ISSUER_KEY", "jetrl-tests-prompt-issuer")

from services.bus.nats_cluster import NatsCluster
from services.bus.nats_server import NatsServer


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """A real 3-node JetStream cluster on 127.0.0.1, started and ready."""
    c = NatsCluster(tmp_path / "cluster", 3).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (char tokenizer, Llama 64x2), built locally once per test session."""
    from services.inference.make_model import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def ascii_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with the printable-ASCII vocabulary (`make-model --vocab ascii`): it can spell
    JSON and tool-call markup, which the default vocabulary cannot."""
    from services.inference.make_model import build_model

    return build_model(tmp_path_factory.mktemp("models") / "ascii", vocab="ascii")


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Any]:
    """A plain nats-py connection to the test's server, jetrl's streams declared."""
    import nats

    from services.common.bus import declare_streams

    conn = await nats.connect(nats_url)
    await declare_streams(conn.jetstream())
    try:
        yield conn
    finally:
        await conn.close()
