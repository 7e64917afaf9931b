"""Benchmark: CPU inference server tokens/s at concurrency 1, 4, 16, 64, as ratios to concurrency 1.

Starts `jetrl inference` on the tiny model (built locally if needed) as a real process and drives it
with the real `SGLangClient` client: `concurrency` workers, each sending one request after another
(prompt of 8 tokens, 64 new tokens, `ignore_eos` so every request costs the same). Iteration-level
batching should make throughput grow with concurrency; the headline `score` is the ratio at 16
(target >= 4). Run: `python bench/inference.py [--model DIR] [--new-tokens N]`.

`--rollout` measures the server's own cost in the shape `jetrl up` gives it: `--groups` groups in
flight, each 8 samples of a copy3 prompt with 4 new tokens at temperature 1 (one batched `/generate`
per group, as the rollout client sends). It prints the server's start-up (seconds to `/health` 200 and
its CPU-seconds then), its CPU-seconds per 1000 samples under load (read from /proc, the client's own
work excluded; also split between the event loop's thread and the others, the model thread mostly) and the rows of its
model forwards; `--src DIR` runs the server from another checkout
and `--server-arg key=value` passes a setting, for before/after comparisons.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from services.common.ports import free_port
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import ModelRequest, SGLangClient

LEVELS = (1, 4, 16, 64)


def start_server(model: Path, port: int, log_path: Path, args: tuple[str, ...] = ("max_batch_size=64",),
                 src: str = "") -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if src:
        env["PYTHONPATH"] = src
    cmd = [sys.executable, "-m", "services.inference", f"model_path={model}", f"port={port}", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, cwd=src or None)
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


async def level(engine: SGLangClient, concurrency: int, requests: int, new_tokens: int) -> tuple[float, int, float]:
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
    engine = SGLangClient(InferenceClientSettings(servers=[url]))
    try:
        await level(engine, 4, 8, new_tokens)  # warm-up: first-call allocations, connection pool
        return {c: await level(engine, c, max(12, 4 * c), new_tokens) for c in LEVELS}
    finally:
        await engine.aclose()


def build_tiny(tmp: Path) -> Path:
    from services.inference.make_model import build_model

    return Path(build_model(tmp / "tiny"))


def cpu_s(pid: int) -> float:
    """CPU-seconds (user + system) process `pid` has used so far."""
    return _stat_cpu(Path(f"/proc/{pid}/stat"))


def _stat_cpu(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU-seconds so far of process `pid`'s main thread (the server's event loop: HTTP, JSON, the
    schedule) and of its other threads together (the model thread, mostly)."""
    out = {"event_loop": 0.0, "other_threads": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out["event_loop" if task.name == str(pid) else "other_threads"] += _stat_cpu(task / "stat")
        except OSError:  # the thread ended meanwhile
            continue
    return out


async def rollout_load(url: str, pid: int, groups: int, samples: int, think_s: float = 0.0) -> dict[str, object]:
    """`groups` closed-loop groups of 8 copy3 samples (4 new tokens) until `samples` are done, each
    pausing a random 0..`think_s` between groups (a rollout worker scores and publishes a group before
    it sends the next prompt, so groups do not arrive in lock step); the server's CPU-seconds per 1000
    samples over that window and its forward batch rows."""
    engine = SGLangClient(InferenceClientSettings(servers=[url]))
    done = 0
    rng = random.Random(0)

    async def group_loop() -> None:
        nonlocal done
        while done < samples:
            done += 8
            prompt = [1, *(6 + rng.randrange(10) for _ in range(3)), 16]  # "ddd=" in the chat template
            await asyncio.gather(*(engine.agenerate(ModelRequest(prompt, max_new_tokens=4, temperature=1.0)) for _ in range(8)))
            await asyncio.sleep(rng.random() * think_s)

    try:
        await asyncio.gather(*(engine.agenerate(ModelRequest([1, 6, 7, 8, 16], max_new_tokens=4)) for _ in range(8)))
        async with httpx.AsyncClient() as http:
            before = (await http.get(url + "/server_info")).json()
        cpu0, threads0, t0 = cpu_s(pid), thread_cpu_s(pid), time.perf_counter()
        await asyncio.gather(*(group_loop() for _ in range(groups)))
        cpu, wall = cpu_s(pid) - cpu0, time.perf_counter() - t0
        threads = {k: round(1000 * (v - threads0.get(k, 0.0)) / done, 3) for k, v in thread_cpu_s(pid).items()}
        async with httpx.AsyncClient() as http:
            after = (await http.get(url + "/server_info")).json()
    finally:
        await engine.aclose()
    rows = {kind: {int(k): n - int(before.get("forward_rows", {}).get(kind, {}).get(k, 0)) for k, n in c.items()}
            for kind, c in after.get("forward_rows", {}).items()}
    return {"samples": done, "server_cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
            "server_cpu_s_per_1000_samples": round(1000 * cpu / done, 3),
            "per_thread_cpu_s_per_1000_samples": {k: v for k, v in sorted(threads.items()) if v},
            "model_steps": after["model_steps"] - before["model_steps"],
            "forward_rows": {kind: {k: n for k, n in sorted(c.items()) if n} for kind, c in rows.items()}}


def rollout(args: argparse.Namespace, model: Path, tmp: str) -> int:
    port = free_port()
    t0 = time.perf_counter()
    proc = start_server(model, port, Path(tmp) / "server.log", tuple(args.server_arg), args.src)
    startup = {"startup_s": round(time.perf_counter() - t0, 3), "startup_cpu_s": round(cpu_s(proc.pid), 3)}
    try:
        result = asyncio.run(rollout_load(f"http://127.0.0.1:{port}", proc.pid, args.groups, args.samples, args.think_ms / 1000))
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    for kind, rows in result["forward_rows"].items():  # type: ignore[attr-defined]
        total = sum(rows.values())
        mean = sum(k * n for k, n in rows.items()) / max(1, total)
        print(f"{kind} forwards: {total}, mean rows {mean:.1f}, rows: {rows}")
    print(json.dumps({**startup, **result, "groups": args.groups, "think_ms": args.think_ms, "src": args.src or ".",
                      "server_args": args.server_arg, "load_average": os.getloadavg()[0]}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="HF model directory (default: build the tiny model)")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--rollout", action="store_true", help="the server's CPU per sample in jetrl up's shape")
    parser.add_argument("--groups", type=int, default=32, help="--rollout: groups of 8 in flight")
    parser.add_argument("--samples", type=int, default=8192, help="--rollout: samples to generate")
    parser.add_argument("--think-ms", type=float, default=20.0, help="--rollout: longest pause of a group loop between two groups")
    parser.add_argument("--src", default="", help="--rollout: run the server from this checkout")
    parser.add_argument("--server-arg", action="append", default=[], help="--rollout: a server setting key=value")
    args = parser.parse_args()
    if args.rollout:
        with tempfile.TemporaryDirectory() as tmp:
            return rollout(args, Path(args.model) if args.model else build_tiny(Path(tmp)), tmp)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_tiny(Path(tmp))
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
