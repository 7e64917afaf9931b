"""The weight-update group built before the first version (`WeightBroadcaster.build_ahead`, which
the trainer runs while its engine is built): it waits for the servers to come up, and the first
version then goes out on that group, with no rendezvous of its own."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
import torch

from services.common.nats_server import free_port
from tests.support.inference import running_servers, spawn_server, wait_ready


def _model_state(model_dir: Path, shift: float) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return {n: p.detach() + shift for n, p in model.named_parameters()}


def _served_version(url: str) -> str:
    return str(httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"])


@pytest.mark.timeout(240)
async def test_the_group_is_built_once_the_server_is_up_and_the_first_version_uses_it(tiny_model: Path, tmp_path: Path) -> None:
    from services.weights.sender.broadcast import WeightBroadcaster

    server = spawn_server(tiny_model, tmp_path)  # still loading: build_ahead waits for its /health
    try:
        sender = WeightBroadcaster([server.url], bucket_mb=0.05, timeout_s=20)
        try:
            assert await sender.build_ahead(wait_s=180, poll_s=0.2) == [server.url]
            wait_ready(server)
            first = await sender.send_version(1, _model_state(tiny_model, 0.01))
            assert first.loaded == [server.url] and first.failed == {} and first.rebuilds == 0, first
            assert _served_version(server.url) == "1"
        finally:
            await sender.aclose()
    finally:
        server.stop(signal.SIGKILL, timeout=10)


@pytest.mark.timeout(240)
async def test_a_server_still_down_at_the_deadline_is_left_out_and_joins_at_a_later_version(tiny_model: Path, tmp_path: Path) -> None:
    from services.weights.sender.broadcast import WeightBroadcaster

    absent = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    with running_servers(tiny_model, tmp_path, 1) as (real,):
        sender = WeightBroadcaster([real.url, absent], bucket_mb=0.05, timeout_s=20)
        try:
            assert await sender.build_ahead(wait_s=1.0, poll_s=0.2) == [real.url]
            first = await sender.send_version(1, _model_state(tiny_model, 0.01))
            assert first.loaded == [real.url] and first.rebuilds == 0 and "unreachable" in first.failed[absent], first
            assert _served_version(real.url) == "1"
        finally:
            await sender.aclose()


@pytest.mark.timeout(120)
async def test_nothing_is_built_ahead_once_a_version_is_being_sent(tiny_model: Path, tmp_path: Path) -> None:
    from services.weights.sender.broadcast import WeightBroadcaster

    with running_servers(tiny_model, tmp_path, 1) as (real,):
        sender = WeightBroadcaster([real.url], bucket_mb=0.05, timeout_s=20)
        try:
            first = await sender.send_version(1, _model_state(tiny_model, 0.01))
            assert first.loaded == [real.url] and first.rebuilds == 1
            address = sender.address
            assert await sender.build_ahead(wait_s=5) == [real.url] and sender.address == address  # the same group
        finally:
            await sender.aclose()
