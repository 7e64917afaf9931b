"""The trainer-side gather + send of one weight version under ZeRO-3 on 2 CPU ranks (torchrun, gloo),
to one real CPU inference server over the broadcast, two ways, alternating in the same run:

- `full`: what the trainer did before streaming: every rank takes part in gathering the whole float32
  state on rank 0 (`TrainEngine.full_state_dict`), then rank 0 buckets and sends it.
- `streamed`: the gather bucket by bucket into the sender (`services/trainer/model/gather.py` into a
  `BucketStream`): bucket n+1 is gathered while bucket n is on the wire.

Per version: `gather s` (what the training call pays: until the gather returns on rank 0), `loaded s`
(until the server answered that the version is swapped in) and rank 0's peak of gathered bytes held
(`held MB`). The group is built by an untimed first version. Uses bench/weights.py's model builder.

    python bench/weights_zero3.py [--mb 100] [--rounds 3] [--bucket-mb 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


async def rank0(engine: object, url: str, rounds: int, bucket_mb: float, out: Path) -> None:
    from services.trainer.model.gather import StreamSpec, gather_stream
    from services.weights.sender.broadcast import WeightBroadcaster
    from services.weights.sender.bucket_stream import BucketStream

    sender = WeightBroadcaster([url], dtype="float32", bucket_mb=bucket_mb, timeout_s=300)
    spec = StreamSpec("float32", sender.bucket_bytes)
    rows = []
    try:
        for i in range(2 * rounds + 1):
            mode = "full" if i % 2 else "streamed"
            await asyncio.to_thread(_barrier)
            t0 = time.perf_counter()
            if mode == "full":
                state = await asyncio.to_thread(engine.full_state_dict)  # type: ignore[attr-defined]
                gather_s = time.perf_counter() - t0
                result = await sender.send_version(i + 1, state)
                del state
            else:
                stream = BucketStream(asyncio.get_running_loop())
                task = asyncio.create_task(sender.send(i + 1, stream))
                await asyncio.to_thread(gather_stream, engine, spec, stream)
                gather_s = time.perf_counter() - t0
                result = await task
            loaded_s = time.perf_counter() - t0
            if result.loaded != [url]:
                raise RuntimeError(f"broadcast failed: {result.failed}")
            if i:  # the first built the group
                rows.append({"mode": mode, "gather_s": gather_s, "loaded_s": loaded_s, "held_mb": result.held_peak_bytes / 1e6,
                             "mb": result.bytes / 1e6, "buckets": result.buckets})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        await asyncio.to_thread(_barrier)  # releases rank 1's last round
        await sender.aclose()
    await asyncio.to_thread(out.write_text, json.dumps(rows))


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def worker(model: str, url: str, rounds: int, bucket_mb: float, out: Path) -> None:
    from services.trainer.model.engine import TrainEngine
    from services.trainer.model.gather import StreamSpec, gather_stream
    from services.trainer.settings import TrainerSettings

    engine = TrainEngine(TrainerSettings(model_path=model, zero_stage=3, seed=0))
    if engine.rank == 0:
        asyncio.run(rank0(engine, url, rounds, bucket_mb, out))
    else:
        spec = StreamSpec("float32", max(1, int(bucket_mb * 1e6)))
        for i in range(2 * rounds + 1):
            _barrier()
            if i % 2:
                engine.full_state_dict()
            else:
                gather_stream(engine, spec, None)
        _barrier()
    sys.stdout.flush()
    os._exit(0)  # past ZeRO-3's abort at interpreter exit


def main() -> None:
    from bench.weights import build_model
    from services.common.nats_server import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=100, choices=(100, 1000))
    parser.add_argument("--rounds", type=int, default=3, help="versions per mode, alternating")
    parser.add_argument("--bucket-mb", type=float, default=16.0, help="weights.bucket_mb")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="jetrl-bench-zero3-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        model = work / "model"
        build_model(model, args.mb)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        log = open(work / "server.log", "wb")
        procs.append(subprocess.Popen([sys.executable, "-m", "services.inference", f"model_path={model}", f"port={port}"],
                                      cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        from bench.weights import wait_healthy

        asyncio.run(wait_healthy(url, procs[0]))
        out = work / "rows.json"
        worker_args = ["--worker", str(model), url, str(args.rounds), str(args.bucket_mb), str(out)]
        trainer = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                                  __file__, *worker_args], cwd=ROOT, env=env)
        if trainer.returncode != 0:
            raise SystemExit(f"trainer ranks failed ({trainer.returncode})")
        rows = json.loads(out.read_text())
        print(f"{'mode':<9} {'gather s':>9} {'loaded s':>9} {'held MB':>8} {'model MB':>9} {'buckets':>8}")
        for r in rows:
            print(f"{r['mode']:<9} {r['gather_s']:>9.3f} {r['loaded_s']:>9.3f} {r['held_mb']:>8.0f} {r['mb']:>9.0f} {r['buckets']:>8}")
        print(json.dumps(figures(rows)))
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)


def figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of each mode; `score`: the full gather's publish-to-loaded time over the streamed
    one's (> 1: a version reaches the servers sooner streamed)."""
    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode)

    full, streamed = med("full", "loaded_s"), med("streamed", "loaded_s")
    return {"score": round(full / streamed, 3) if streamed else None, "full_loaded_s": full, "streamed_loaded_s": streamed,
            "full_gather_s": med("full", "gather_s"), "streamed_gather_s": med("streamed", "gather_s"),
            "full_held_mb": med("full", "held_mb"), "streamed_held_mb": med("streamed", "held_mb"), "model_mb": rows[0]["mb"]}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), Path(sys.argv[6]))
    else:
        main()
