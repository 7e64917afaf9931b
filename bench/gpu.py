"""The GPU figures: trainer tokens/s and MFU in bf16, the inference server's tokens/s on the GPU, and a
colocated weight update against a disk round trip, for Qwen2.5-0.5B- and 1.5B-shaped models (random
weights, built locally from their configs). Needs a CUDA GPU (exits saying so otherwise).

    python bench/gpu.py [--models 0.5b,1.5b] [--samples 8] [--seq-len 4096] [--out DIR]

- peak: a bf16 8192^3 matmul's TFLOP/s measured on this card (the MFU denominator), beside the spec.
- trainer: one PPO update (decoupled PPO: a proximal forward, then forward + backward) of the real
  `TrainEngine` on one rank (DeepSpeed, NCCL, no ZeRO) in bf16 with the real-model settings
  (`max_tokens_per_microbatch` = seq_len, `pack_sequences`, `gradient_checkpointing`,
  `logp_chunk_tokens` 1024, the fused output head) on `--samples` x `--seq-len` tokens, timed on the
  second update; peak GPU memory over it. MFU = model FLOPs / (seconds x peak), model FLOPs per token
  = 6 x parameters + 6 x layers x hidden x seq_len (causal attention, forward + backward); the
  proximal forward and the checkpointing's recompute are work done on top (not counted).
- server: `jetrl inference device=cuda dtype=bfloat16` on the 0.5B shape, output tokens/s of 1 and
  of 64 concurrent requests (128-token prompts, 256 new tokens each, greedy, ignore_eos).
- update: a version of each model handed to a server on the same GPU through `/update_weights_from_tensor`
  by CUDA IPC handle (`ColocatedSender`, bf16) against a disk round trip of the same bytes (safetensors
  written to local disk, then `/update_weights_from_disk`), each until the server answered.

Writes `gpu.md` (the tables) and `gpu.json` under `--out`; prints the tables and a last JSON line whose
`score` is the 0.5B trainer MFU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {  # Qwen2.5 configs: hidden, layers, heads, kv heads, intermediate (vocab 151936, tied embeddings)
    "0.5b": (896, 24, 14, 2, 4864),
    "1.5b": (1536, 28, 12, 2, 8960),
}
VOCAB = 151936
SPEC_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
"""Dense bf16 spec of known cards (TFLOP/s), printed beside the measured peak."""


def build(out: Path, shape: str) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv, ffn = SHAPES[shape]
    cfg = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=ffn, vocab_size=VOCAB, max_position_embeddings=32768, tie_word_embeddings=True,
                      rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(out, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return n


def matmul_tflops() -> float:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * n / (time.perf_counter() - t0) / 1e12


def trainer_worker(model: str, samples: int, seq_len: int, result: str) -> None:
    """One process: two updates, the second timed (the first allocates the optimizer states)."""
    import torch

    from bench.trainer_memory import batch
    from services.trainer.intake.batch import shard
    from services.trainer.model.actor import PPOActor
    from services.trainer.model.engine import TrainEngine
    from services.trainer.settings import TrainerSettings

    s = TrainerSettings.model_validate({"model_path": model, "dtype": "bfloat16", "zero_stage": 0, "pack_sequences": True,
                                        "gradient_checkpointing": True, "logp_chunk_tokens": 1024,
                                        "max_tokens_per_microbatch": seq_len})
    engine = TrainEngine(s)
    actor = PPOActor(engine, s.ppo)
    b = batch(samples, seq_len, VOCAB, "uniform")
    tokens = int(b["attention_mask"].sum())
    for i in range(2):
        if i == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        stats = actor.ppo_update(shard(b, 1, 1)[0])
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    Path(result).write_text(json.dumps({"tokens": tokens, "seconds": seconds, "peak_bytes": torch.cuda.max_memory_allocated(),
                                        "loss": float(stats["loss"]), "device": str(engine.device)}))


def run_trainer(model: Path, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    result = tmp / f"trainer-{model.name}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cuda"}
    code = f"from bench.gpu import trainer_worker; trainer_worker({str(model)!r}, {args.samples}, {args.seq_len}, {str(result)!r})"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=args.stage_timeout_s)
    if out.returncode != 0:
        return {"error": out.stderr[-1500:]}
    return json.loads(result.read_text())


async def serve_and_update(model: Path, tmp: Path, concurrency: list[int], timeout_s: float) -> dict[str, Any]:
    """Start a bf16 CUDA server on `model`: tokens/s at each concurrency, then colocated vs disk update."""
    import httpx
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from services.weights.sender.colocated import ColocatedSender
    from tests.support.inference import spawn_server, wait_ready

    server = wait_ready(spawn_server(model, tmp, "device=cuda", "dtype=bfloat16", "skip_tokenizer_init=true",
                                     "max_batch_size=64", "context_length=4096"), timeout=timeout_s)
    out: dict[str, Any] = {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            for c in concurrency:
                params: dict[str, Any] = {"max_new_tokens": 256, "temperature": 0, "ignore_eos": True}
                body: dict[str, Any] = {"input_ids": list(range(10, 138)), "sampling_params": params}
                warm = {**body, "sampling_params": {**params, "max_new_tokens": 8}}
                await http.post(f"{server.url}/generate", json=warm)
                t0 = time.perf_counter()
                replies = await asyncio.gather(*(http.post(f"{server.url}/generate", json=body) for _ in range(c)))
                seconds = time.perf_counter() - t0
                made = sum(len(r.json()["output_ids"]) for r in replies)
                out[f"server_tokens_per_s_c{c}"] = made / seconds
        state = {n: p.detach().to("cuda", torch.bfloat16) for n, p in
                 AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).named_parameters()}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        sender = ColocatedSender([server.url], dtype="bfloat16", bucket_mb=256, timeout_s=timeout_s)
        try:
            times = []
            for v in range(1, 5):  # the first two make the buffer sets
                t0 = time.perf_counter()
                result = await sender.send_version(v, state)
                times.append(time.perf_counter() - t0)
                if result.loaded != [server.url]:
                    raise RuntimeError(f"colocated update failed: {result.failed}")
        finally:
            await sender.aclose()
        disk = tmp / f"disk-{model.name}"
        disk.mkdir()
        (disk / "config.json").write_bytes((model / "config.json").read_bytes())
        t0 = time.perf_counter()
        save_file({n: t.contiguous().cpu() for n, t in state.items()}, str(disk / "model.safetensors"))
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            r = await http.post(f"{server.url}/update_weights_from_disk", json={"model_path": str(disk), "weight_version": "9",
                                                                                "flush_cache": False})
        disk_s = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"disk update failed: {r.text[:300]}")
        out.update(update_bytes=nbytes, colocated_s=min(times[2:]), colocated_first_s=max(times[:2]), disk_s=disk_s)
    finally:
        server.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="0.5b,1.5b")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--out", default="", help="directory for gpu.md and gpu.json")
    parser.add_argument("--stage-timeout-s", type=float, default=240.0)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU: torch sees none here (torch "
                         f"{torch.__version__}). Run it through the device check: docs/gpu.md.")
    card = torch.cuda.get_device_name(0)
    spec = next((v for k, v in SPEC_TFLOPS.items() if k in card), None)
    peak = matmul_tflops()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="jetrl-bench-gpu-") as t:
        tmp = Path(t)
        for shape in args.models.split(","):
            model = tmp / shape
            params = build(model, shape)
            hidden, layers, *_ = SHAPES[shape]
            row: dict[str, Any] = {"model": shape, "params": params}
            tr = run_trainer(model, args, tmp)
            if "error" in tr:
                row["trainer_error"] = tr["error"]
            else:
                flops = (6 * params + 6 * layers * hidden * args.seq_len) * tr["tokens"]
                row.update(trainer_tokens_per_s=tr["tokens"] / tr["seconds"], mfu=flops / tr["seconds"] / (peak * 1e12),
                           trainer_peak_gb=tr["peak_bytes"] / 2**30, trainer_s=tr["seconds"])
            try:
                row.update(asyncio.run(serve_and_update(model, tmp, [1, 64] if shape == "0.5b" else [], args.stage_timeout_s)))
            except Exception as exc:  # a figure missing, not the others
                row["server_error"] = repr(exc)[:500]
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [f"card: {card}; bf16 matmul peak measured {peak:.0f} TFLOP/s" + (f" (spec {spec:.0f})" if spec else ""),
             f"trainer: {args.samples} x {args.seq_len} tokens, bf16, one rank, no ZeRO, packed, checkpointed, chunked log-probs",
             "", "| model | params | trainer tok/s | MFU | peak GB | server tok/s c1 | c64 | colocated update s | disk round trip s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["model"], f"{r['params'] / 1e9:.2f}B", _f(r.get("trainer_tokens_per_s"), 0), _f(r.get("mfu"), 3),
                 _f(r.get("trainer_peak_gb"), 1), _f(r.get("server_tokens_per_s_c1"), 0), _f(r.get("server_tokens_per_s_c64"), 0),
                 _f(r.get("colocated_s"), 3), _f(r.get("disk_s"), 2)]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    figures = {"card": card, "peak_tflops": peak, "rows": rows}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu.md").write_text(text + "\n")
        (Path(args.out) / "gpu.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps({"score": rows[0].get("mfu") if rows else None, **figures}))


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    main()
