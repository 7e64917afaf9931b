"""Helpers of the weight-sync tests: real CPU inference servers and weights agents as processes, a
checkpoint per version, the reports the agents publish."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import nats
from safetensors.torch import load_file, save_file

from schemas.messages import WeightsLoaded, WeightsLoadFailed, decode
from schemas.subjects import WEIGHTS_BUCKET, Subjects

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0


def make_version(tiny_model: Path, out: Path, version: int) -> Path:
    """A checkpoint of the tiny model with every weight shifted by `version` (distinct bytes)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v + 0.001 * version for k, v in load_file(str(tiny_model / "model.safetensors")).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(tiny_model / "config.json", out / "config.json")
    return out


@contextmanager
def process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "JETRL_LOG_FORMAT": "json"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    async with httpx.AsyncClient() as http:
        deadline = asyncio.get_running_loop().time() + TIMEOUT_S
        while asyncio.get_running_loop().time() < deadline:
            assert proc.poll() is None, f"inference server exited:\n{log.read_text()[-3000:]}"
            try:
                if (await http.get(f"{url}/health", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} not healthy:\n{log.read_text()[-3000:]}")


class Stack:
    """Inference servers + one agent each, and a NATS connection to watch the reports."""

    def __init__(self, nats_url: str, run: str, tmp: Path, tiny_model: Path) -> None:
        self.nats_url, self.run, self.tmp, self.tiny_model = nats_url, run, tmp, tiny_model
        self.servers: list[str] = []
        self.reports: asyncio.Queue[WeightsLoaded | WeightsLoadFailed] = asyncio.Queue()

    def server_args(self, port: int) -> list[str]:
        return ["-m", "services.inference", f"model_path={self.tiny_model}", f"port={port}", f"run={self.run}"]

    def agent_args(self, url: str, i: int) -> list[str]:
        return ["-m", "services.weights", f"server={url}", f"nats_url={self.nats_url}", f"run={self.run}",
                f"cache_dir={self.tmp / f'cache{i}'}", "keep_local=1",
                # the object store and the shared directory the tests publish to
                f'weight_roots=["nats-os://{WEIGHTS_BUCKET}/{self.run}/", "{(self.tmp / "shared").as_uri()}"]']

    async def watch(self, nc: nats.aio.client.Client) -> None:
        subjects = Subjects(self.run)

        async def on_loaded(msg: nats.aio.msg.Msg) -> None:
            await self.reports.put(decode(WeightsLoaded, msg.data))

        async def on_failed(msg: nats.aio.msg.Msg) -> None:
            await self.reports.put(decode(WeightsLoadFailed, msg.data))

        await nc.subscribe(subjects.weights_loaded_all, cb=on_loaded)
        await nc.subscribe(f"jetrl.{self.run}.weights.failed.>", cb=on_failed)

    async def expect(self, kind: type, version: int, n: int) -> list:
        """The next `n` reports, each of `kind` for `version` (reports of older versions are skipped)."""
        got = []
        while len(got) < n:
            report = await asyncio.wait_for(self.reports.get(), TIMEOUT_S)
            if report.version < version:
                continue
            assert isinstance(report, kind), f"expected {kind.__name__} v{version}, got {report!r}"
            assert report.version == version
            got.append(report)
        return got


async def server_version(url: str) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{url}/model_info")).json()["weight_version"]
