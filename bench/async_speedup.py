"""Asynchronous vs synchronous RL on the whole local stack (`jetrl up`): the same number of trainer
steps with eta = 0 (synchronous: the feeder issues one batch and waits for all of it) and eta = 4,
against the inference server's simulated long-tailed latency mode, so generation time has the shape
of real LLM decoding rather than of CPU decoding of the tiny model.

Prints wall times (from the first to the last trainer step, start-up excluded), their ratio (the
score), the trainer's wait fraction and the inference server's idle fraction (sampled from /v1/loads)
in each mode. AReaL reports up to 2.77x; target here: >= 2.5x with the trainer waiting < 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def sample_idle(run_dir: Path, stop: threading.Event, samples: list[int]) -> None:
    """Poll the inference server's load; a sample with no running request counts as idle."""
    import httpx

    url = None
    while not stop.is_set():
        if url is None:
            try:
                url = _server_url(json.loads((run_dir / "procs.json").read_text()))
            except Exception:  # not started yet
                pass
        if url:
            try:
                samples.append(requests_in_server(httpx.get(f"{url}/v1/loads", timeout=1.0).json()))
            except Exception:
                pass
        stop.wait(0.05)


def requests_in_server(loads: dict) -> int:
    """Running + waiting requests over the data-parallel ranks of a `/v1/loads` answer (SGLang 0.5.8+;
    `/get_load` is gone from 0.5.21)."""
    return sum(int(r.get("num_running_reqs", 0)) + int(r.get("num_waiting_reqs", 0)) for r in loads["loads"])


def _server_url(pids: dict[str, int]) -> str | None:
    import psutil

    pid = pids.get("inference-0")
    if pid is None:
        return None
    env = psutil.Process(pid).environ()
    port = env.get("JETRL_INFERENCE__PORT")
    return f"http://127.0.0.1:{port}" if port else None


def run_mode(workdir: Path, eta: int, steps: int, token_latency_s: float) -> dict[str, float]:
    run = f"eta{eta}"
    config = {
        "inference": {
            "simulate": True,
            "max_batch_size": 256,
            "sim": {"token_latency_s": token_latency_s, "median_new_tokens": 24, "length_sigma": 1.0},
        },
        "rollout": {"max_new_tokens": 256, "max_concurrent": 64},
        "trainer": {"eta": eta, "checkpoint_every": 0, "feeder": {"max_in_flight": 256}},
    }
    cfg = workdir / f"{run}.yaml"
    cfg.write_text(yaml.safe_dump(config))
    run_dir = workdir / run
    stop = threading.Event()
    samples: list[int] = []
    sampler = threading.Thread(target=sample_idle, args=(run_dir, stop, samples), daemon=True)
    sampler.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "services.up", "--config", str(cfg), f"run={run}", f"run_dir={workdir}",
         f"total_steps={steps}", "display=lines", f"model_path={workdir / 'model'}", "rollout_workers=2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"jetrl up (eta={eta}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    history = json.loads((run_dir / "metrics.json").read_text())["steps"]
    wall = history[-1]["time"] - history[0]["time"]
    waits = [s.get("data_wait_fraction", 0.0) for s in history[1:]]
    return {
        "wall_s": wall,
        "steps": len(history),
        "trainer_wait_fraction": sum(waits) / max(len(waits), 1),
        "inference_idle_fraction": sum(1 for n in samples if n == 0) / max(len(samples), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12, help="trainer steps per mode")
    parser.add_argument("--token-latency", type=float, default=0.01, help="simulated seconds per decoded token")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jetrl-bench-async-") as tmp:
        workdir = Path(tmp)
        sync = run_mode(workdir, 0, args.steps, args.token_latency)
        asyn = run_mode(workdir, 4, args.steps, args.token_latency)
    ratio = sync["wall_s"] / asyn["wall_s"]
    print(f"{'mode':<14}{'wall s':>9}{'trainer wait':>14}{'server idle':>13}")
    for name, r in (("sync eta=0", sync), ("async eta=4", asyn)):
        print(f"{name:<14}{r['wall_s']:>9.1f}{r['trainer_wait_fraction']:>14.2f}{r['inference_idle_fraction']:>13.2f}")
    print(f"speedup (sync wall / async wall) over {args.steps - 1} steps: {ratio:.2f}x  (target >= 2.5x, async trainer wait < 0.10)")
    print(json.dumps({
        "score": round(ratio, 3),
        "sync_wall_s": round(sync["wall_s"], 2),
        "async_wall_s": round(asyn["wall_s"], 2),
        "sync_trainer_wait": round(sync["trainer_wait_fraction"], 3),
        "async_trainer_wait": round(asyn["trainer_wait_fraction"], 3),
        "sync_server_idle": round(sync["inference_idle_fraction"], 3),
        "async_server_idle": round(asyn["inference_idle_fraction"], 3),
    }))


if __name__ == "__main__":
    main()
