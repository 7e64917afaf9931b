"""Weight sync latency: publish a checkpoint -> every agent reports it loaded into its server.

For models of about 100 MB and 1 GB, through the WEIGHTS object store and through a shared
directory, with a real nats-server, a real CPU inference server and a real `jetrl weights` agent.
Baseline: the time to copy the same bytes on local disk in this run (shutil.copyfile), so
ratio = copy_s / publish_to_loaded_s (1.0 would be "as fast as cp"). score = the 1 GB object-store
ratio. Everything is written under a temp dir that is removed at the end.

The checkpoint is written as the trainer writes it: safetensors shards of at most
`shard_bytes(model size)` (the trainer's default `weights_shard_mb`), in a fresh directory per
version that is handed over to the publisher (`consume=True`). Making that directory (the trainer's
own save) is not timed.

The broadcast (`services/weights/sender/broadcast.py`): the trainer's sending side holds the parameters in
memory (as it does after a step; loading them from the checkpoint is not timed) and sends them over a
gloo group to the server, in float32, 64 MB buckets, each checksummed; publish-to-loaded is until the
server answered that the version is swapped in. The group is built by an untimed first version.
`pause ms` is the swap-in: the only time decoding waits (read from the server's log).

Colocated (`services/weights/sender/colocated.py`, `jetrl up`'s default): the same parameters copied once
into shared memory and handed to the server by handle with `/update_weights_from_tensor` (float32,
64 MB buckets, the server adopting the buffers); publish-to-loaded is until the server answered. The
two buffer sets are made by two untimed first versions (their time is printed as `first s`).
score = the 1 GB colocated ratio when colocated is measured (else the 1 GB object-store ratio).

The nats-server's own CPU time is measured across each publish-to-loaded too: through the object
store every byte goes into the server's file store and out again, and `bound` is the ratio this
machine could reach if the Python clients cost nothing and the server's work were spread over every
core. When `bound` is under the target, the object-store path needs more cores than this machine has.

    python bench/weights.py [--sizes 100,1000] [--repeats 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import httpx  # noqa: E402
import nats  # noqa: E402
from nats.aio.msg import Msg  # noqa: E402

from schemas.messages import WeightsLoaded, WeightsLoadFailed, decode  # noqa: E402
from services.common.nats_server import NatsServer, free_port  # noqa: E402
from services.weights.sender.broadcast import WeightBroadcaster  # noqa: E402
from services.weights.sender.colocated import ColocatedSender  # noqa: E402
from services.weights.sender.publisher import WeightPublisher, ensure_weight_sync_stream  # noqa: E402

CORES = os.cpu_count() or 1
# (hidden, ffn, layers) of a Llama with the tiny char vocabulary: fp32 bytes ~ 4 * layers * (4h^2 + 3h*ffn).
SHAPES = {100: (896, 3584, 2), 1000: (2048, 8192, 4)}


def build_model(out: Path, mb: int) -> int:
    """A Llama checkpoint of about `mb` MB: random N(0, 0.02) tensors written directly (random init
    through transformers takes far longer at 1 GB and is not what is measured)."""
    import torch
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoModelForCausalLM, LlamaConfig

    from services.inference.make_model import CHARS, SPECIALS, build_tokenizer
    from services.weights.files import shard_bytes

    hidden, ffn, layers = SHAPES[mb]
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    config = LlamaConfig(vocab_size=len(SPECIALS) + len(CHARS), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, intermediate_size=ffn,
                         max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    config.dtype = "float32"
    config.save_pretrained(out)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    shapes.pop("lm_head.weight", None)  # tied to the embeddings, saved once
    gen = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
    shard = shard_bytes(sum(t.numel() * t.element_size() for t in tensors.values()))
    save_torch_state_dict(tensors, out, max_shard_size=shard, metadata={"format": "pt"})
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def copy_seconds(src: Path, dst: Path) -> float:
    t0 = time.perf_counter()
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_file():
            shutil.copyfile(p, dst / p.name)
    return time.perf_counter() - t0


async def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    async with httpx.AsyncClient() as http:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"inference server exited with {proc.returncode}")
            try:
                if (await http.get(f"{url}/health", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} not healthy in {timeout_s}s")


def start_services(model: Path, work: Path, mb: int, nats_url: str, run: str, port: int,
                   url: str) -> tuple[IO[bytes], list[subprocess.Popen[bytes]]]:
    """The CPU inference server and its `jetrl weights` agent, logging to one file under `work`."""
    env = {**os.environ, "JETRL_LOG_FORMAT": "json"}
    logs = open(work / f"procs{mb}.log", "wb")
    procs = [
        subprocess.Popen([sys.executable, "-m", "services.inference", f"model_path={model}", f"port={port}", f"run={run}"],
                         cwd=ROOT, env=env, stdout=logs, stderr=subprocess.STDOUT),
        subprocess.Popen([sys.executable, "-m", "services.weights", f"server={url}", f"nats_url={nats_url}", f"run={run}",
                          f"cache_dir={work / f'cache{mb}'}", "keep_local=1", "request_timeout_s=600",
                          # both places this bench publishes to (an announcement elsewhere is refused)
                          f'weight_roots=["file://{work / f"shared{mb}"}", "nats-os://WEIGHTS/{run}"]'],
                         cwd=ROOT, env=env, stdout=logs, stderr=subprocess.STDOUT),
    ]
    return logs, procs


async def bench_size(mb: int, work: Path, server: NatsServer, repeats: int, rows: list[dict], transports: list[str]) -> None:
    assert server.proc is not None
    nats_url, nats_pid = server.url, server.proc.pid
    model = work / f"model{mb}"
    size = build_model(model, mb)
    run = f"bench{mb}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs, procs = start_services(model, work, mb, nats_url, run, port, url)
    nc = await nats.connect(nats_url)
    try:
        await ensure_weight_sync_stream(nc)
        reports: asyncio.Queue = asyncio.Queue()

        async def on_report(msg: Msg) -> None:
            cls = WeightsLoaded if ".loaded." in msg.subject else WeightsLoadFailed
            await reports.put(decode(cls, msg.data))

        await nc.subscribe(f"jetrl.{run}.weights.loaded.>", cb=on_report)
        await nc.subscribe(f"jetrl.{run}.weights.failed.>", cb=on_report)
        await wait_healthy(url, procs[0])
        publishers = {
            "object store": WeightPublisher(nc, run, keep_last=1),
            "shared dir": WeightPublisher(nc, run, shared_dir=work / f"shared{mb}", keep_last=1),
        }
        version = 0
        for rep in range(repeats):
            os.sync()
            copy_s = copy_seconds(model, work / f"copy{mb}-{rep}")
            shutil.rmtree(work / f"copy{mb}-{rep}")
            for transport, pub in publishers.items():
                if transport not in transports:
                    continue
                version += 1
                handed = work / f"trainer-out{mb}" / f"v{version}"  # what the trainer would have written
                shutil.copytree(model, handed)
                os.sync()  # every measurement starts with nothing left to write back (as the copy's does)
                nats_cpu0, t0 = cpu_seconds(nats_pid), time.perf_counter()
                await pub.publish_dir(version, version, handed, consume=True)
                publish_s = time.perf_counter() - t0
                report = await asyncio.wait_for(reports.get(), 600)
                total = time.perf_counter() - t0
                nats_cpu = cpu_seconds(nats_pid) - nats_cpu0
                if not isinstance(report, WeightsLoaded):
                    raise RuntimeError(f"load failed: {report.reason}")
                shutil.rmtree(handed, ignore_errors=True)  # the trainer deletes what is left of it
                rows.append({"mb": round(size / 1e6), "transport": transport, "copy_s": copy_s, "publish_s": publish_s,
                             "agent_s": report.seconds, "total_s": total, "ratio": copy_s / total,
                             "nats_cpu_s": nats_cpu,
                             "bound": copy_s * CORES / nats_cpu if transport == "object store" else None})
            if "broadcast" in transports:
                version = await bench_broadcast(model, url, version, copy_s, size, work / f"procs{mb}.log", rows)
            if "colocated" in transports:
                version = await bench_colocated(model, url, version, copy_s, size, work / f"procs{mb}.log", rows)
    finally:
        await nc.close()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        logs.close()
        shutil.rmtree(model, ignore_errors=True)


def _load_state(model: Path) -> dict:
    from safetensors.torch import load_file

    state: dict = {}
    for f in sorted(model.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def _server_line(log: Path, version: int) -> dict:
    """The server's "weights version received" log line of `version` (its swap and receive times)."""
    lines = log.read_text().splitlines()
    return next((json.loads(line) for line in reversed(lines)
                 if '"weights version received"' in line and f'"version": "{version}"' in line), {})


async def bench_colocated(model: Path, url: str, version: int, copy_s: float, size: int, log: Path, rows: list[dict],
                          sends: int = 3) -> int:
    """`sends` timed colocated versions (after two untimed ones that make the two buffer sets)."""
    state = await asyncio.to_thread(_load_state, model)
    sender = ColocatedSender([url], dtype="float32", bucket_mb=64, timeout_s=300)
    first: list[float] = []
    try:
        for i in range(sends + 2):
            version += 1
            t0 = time.perf_counter()
            result = await sender.send_version(version, state)
            total = time.perf_counter() - t0
            if result.loaded != [url]:
                raise RuntimeError(f"colocated update failed: {result.failed}")
            if i < 2:
                first.append(total)
                continue
            server = await asyncio.to_thread(_server_line, log, version)
            rows.append({"mb": round(size / 1e6), "transport": "colocated", "copy_s": copy_s, "publish_s": total, "agent_s": 0.0,
                         "total_s": total, "ratio": copy_s / total, "nats_cpu_s": 0.0, "bound": None,
                         "pause_ms": 1000 * server.get("swap_s", float("nan")),
                         "stages": {**result.stages, "server_prepare_s": server.get("prepare_s", float("nan")),
                                    "first_versions_s": max(first)}})
    finally:
        await sender.aclose()
        del state
    return version


async def bench_broadcast(model: Path, url: str, version: int, copy_s: float, size: int, log: Path, rows: list[dict],
                          sends: int = 3) -> int:
    """`sends` timed broadcasts of the model to the server (after an untimed one that builds the
    group), each with where its time went: the sender's stages (`VersionResult.stages`) and the
    server's (its "weights version received" log line)."""
    from safetensors.torch import load_file

    def load() -> dict:
        state: dict = {}
        for f in sorted(model.glob("*.safetensors")):
            state.update(load_file(str(f)))
        return state

    state = await asyncio.to_thread(load)
    sender = WeightBroadcaster([url], dtype="float32", bucket_mb=64, timeout_s=300)
    try:
        for i in range(sends + 1):
            version += 1
            t0 = time.perf_counter()
            result = await sender.send_version(version, state)
            total = time.perf_counter() - t0
            if result.loaded != [url]:
                raise RuntimeError(f"broadcast failed: {result.failed}")
            if i == 0:
                continue  # built the group
            lines = (await asyncio.to_thread(log.read_text)).splitlines()
            server: dict = next((json.loads(line) for line in reversed(lines)
                           if '"weights version received"' in line and f'"version": "{version}"' in line), {})
            rows.append({"mb": round(size / 1e6), "transport": "broadcast", "copy_s": copy_s, "publish_s": total, "agent_s": 0.0,
                         "total_s": total, "ratio": copy_s / total, "nats_cpu_s": 0.0, "bound": None,
                         "pause_ms": 1000 * server.get("swap_s", float("nan")),
                         "stages": {**result.stages, **{f"server_{k}": server[k] for k in ("receive_s", "check_s") if k in server}}})
    finally:
        await sender.aclose()
    return version


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000", help="model sizes in MB (from: 100, 1000)")
    parser.add_argument("--repeats", type=int, default=1, help="publishes per size and transport")
    parser.add_argument("--transports", default="object store,shared dir,broadcast,colocated",
                        help="comma-separated, from: object store, shared dir, broadcast, colocated")
    args = parser.parse_args()
    rows: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="jetrl-bench-weights-"))
    server = NatsServer(work / "nats", max_file="20GB").start()
    t_start = time.perf_counter()
    try:
        for mb in (int(s) for s in args.sizes.split(",")):
            await bench_size(mb, work, server, args.repeats, rows, args.transports.split(","))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'model':>8} {'transport':<13} {'copy s':>8} {'publish s':>10} {'agent s':>8} {'total s':>8} {'ratio':>6}"
          f" {'nats cpu s':>11} {'bound':>6} {'pause ms':>9}")
    for r in rows:
        bound_text = f"{r['bound']:>6.2f}" if r["bound"] else f"{'-':>6}"
        print(f"{r['mb']:>6}MB {r['transport']:<13} {r['copy_s']:>8.2f} {r['publish_s']:>10.2f} {r['agent_s']:>8.2f} "
              f"{r['total_s']:>8.2f} {r['ratio']:>6.2f} {r['nats_cpu_s']:>11.2f} {bound_text} {r.get('pause_ms', float('nan')):>9.1f}")
    for r in rows:
        if r.get("stages"):
            print(f"{r['mb']:>6}MB {r['transport']} stages (s): " + "  ".join(f"{k} {v:.3f}" for k, v in r["stages"].items())
                  + f"  total {r['total_s']:.3f}")
    print("ratio = local-disk copy time of the same bytes / publish-to-loaded time (publish + fetch + verify + load)")
    print(f"nats cpu s = CPU the nats-server used meanwhile; bound = copy s / (nats cpu s / {CORES} cores): the best"
          " ratio possible here if the clients cost nothing and the server's work were spread over every core")
    print("figures: fastest copy / fastest publish-to-loaded of each size and transport (bound: / least nats cpu)")
    print(f"bench wall time {time.perf_counter() - t_start:.0f}s")

    def best(mb: int, transport: str) -> float | None:
        """Fastest copy over fastest publish-to-loaded of that size: one slow copy (the page cache
        writing back) must not make a repeat look good."""
        sized = [r for r in rows if abs(r["mb"] - mb) < mb * 0.5]
        totals = [r["total_s"] for r in sized if r["transport"] == transport]
        return min(r["copy_s"] for r in sized) / min(totals) if totals else None

    def bound(mb: int) -> float | None:
        sized = [r for r in rows if abs(r["mb"] - mb) < mb * 0.5]
        cpus = [r["nats_cpu_s"] for r in sized if r["transport"] == "object store"]
        return min(r["copy_s"] for r in sized) * CORES / min(cpus) if cpus else None

    figures = {
        "ratio_100mb_object_store": best(100, "object store"),
        "ratio_100mb_shared_dir": best(100, "shared dir"),
        "ratio_1gb_object_store": best(1000, "object store"),
        "ratio_1gb_shared_dir": best(1000, "shared dir"),
        "ratio_100mb_broadcast": best(100, "broadcast"),
        "ratio_1gb_broadcast": best(1000, "broadcast"),
        "pause_ms_100mb_broadcast": min((r["pause_ms"] for r in rows if r["mb"] < 500 and r["transport"] == "broadcast"), default=None),
        "ratio_100mb_colocated": best(100, "colocated"),
        "ratio_1gb_colocated": best(1000, "colocated"),
        "seconds_1gb_colocated": min((r["total_s"] for r in rows if r["mb"] > 500 and r["transport"] == "colocated"), default=None),
        "pause_ms_max_colocated": max((r["pause_ms"] for r in rows if r["transport"] == "colocated"), default=None),
        "bound_1gb_object_store": bound(1000),
        "seconds_1gb_object_store": min((r["total_s"] for r in rows if r["mb"] > 500 and r["transport"] == "object store"), default=None),
    }
    headline = figures["ratio_1gb_colocated"] if figures["ratio_1gb_colocated"] is not None else figures["ratio_1gb_object_store"]
    print(json.dumps({"score": headline, **figures}))


if __name__ == "__main__":
    asyncio.run(main())
