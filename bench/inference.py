"""Benchmark: CPU inference server tokens/s at concurrency 1, 4, 16, 64, as ratios to concurrency 1.

Starts `jetrl inference` on the tiny model (built locally if needed) as a real process and drives it
with the real `InferenceEngine` client: `concurrency` workers, each sending one request after another
(prompt of 8 tokens, 64 new tokens, `ignore_eos` so every request costs the same). Iteration-level
batching should make throughput grow with concurrency; the headline `score` is the ratio at 16
(target >= 4). Run: `python bench/inference.py [--model DIR] [--new-tokens N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import InferenceEngine, ModelRequest

LEVELS = (1, 4, 16, 64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "services.inference", f"model_path={model}", f"port={port}", "max_batch_size=64"]
    proc = subprocess.Popen(cmd, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not become ready in 120 s")


async def level(engine: InferenceEngine, concurrency: int, requests: int, new_tokens: int) -> tuple[float, int, float]:
    """(tokens/s, tokens, mean request latency) with `concurrency` closed-loop workers."""
    prompt = [1, 5, 6, 7, 13, 8, 9, 13]
    todo = list(range(requests))
    latencies: list[float] = []
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while todo:
            todo.pop()
            r = await engine.agenerate(ModelRequest(prompt, max_new_tokens=new_tokens, ignore_eos=True))
            tokens += len(r.output_ids)
            latencies.append(r.latency_s)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return tokens / wall, tokens, sum(latencies) / len(latencies)


async def measure(url: str, new_tokens: int) -> dict[int, tuple[float, int, float]]:
    engine = InferenceEngine(InferenceClientSettings(servers=[url]))
    try:
        await level(engine, 4, 8, new_tokens)  # warm-up: first-call allocations, connection pool
        return {c: await level(engine, c, max(12, 4 * c), new_tokens) for c in LEVELS}
    finally:
        await engine.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="HF model directory (default: build the tiny model)")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per request")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else None
        if model is None:
            from services.inference.make_model import build_model

            model = build_model(Path(tmp) / "tiny")
        port = free_port()
        proc = start_server(model, port, Path(tmp) / "server.log")
        try:
            results = asyncio.run(measure(f"http://127.0.0.1:{port}", args.new_tokens))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    base = results[1][0]
    print(f"CPU inference server, tiny model, {args.new_tokens} new tokens/request (baseline: concurrency 1)")
    print(f"{'concurrency':>11} {'tokens':>7} {'tokens/s':>9} {'ratio':>6} {'mean latency s':>15}")
    for c, (tps, toks, lat) in results.items():
        print(f"{c:>11} {toks:>7} {tps:>9.0f} {tps / base:>6.2f} {lat:>15.3f}")
    figures = {f"tokens_per_s_c{c}": round(v[0], 1) for c, v in results.items()}
    figures.update({f"ratio_c{c}": round(v[0] / base, 3) for c, v in results.items()})
    figures["score"] = round(results[16][0] / base, 3)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
