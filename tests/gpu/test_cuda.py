"""The CUDA paths, on a GPU (marked `gpu`, skipped without CUDA): the trainer's bf16 step against the
CPU float32 step, the fused output head and chunked log-probs against the plain computation, the
inference server generating on the GPU, and a colocated weight update by CUDA IPC handle bit for bit
in the served dtype. None needs a nats-server; the trainer step needs DeepSpeed (the device check
installs it from the carried wheels: infra/gpu_check/)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible")]

ROOT = Path(__file__).resolve().parents[2]


def _update(model: Path, dtype: str, cuda: bool) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cuda" if cuda else "cpu"}
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, "-m", "tests.gpu.one_update", str(model), dtype], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(900)
def test_a_bf16_trainer_step_on_cuda_has_the_loss_of_the_cpu_fp32_step(tiny_model: Path) -> None:
    cpu = _update(tiny_model, "float32", cuda=False)
    gpu = _update(tiny_model, "bfloat16", cuda=True)
    assert (cpu["device"], gpu["device"]) == ("cpu", "cuda")
    # bf16 keeps 8 bits of mantissa (~4e-3 relative per value): per-token quantities agree to ~1e-2,
    # and the loss (42 tokens, -0.10 in fp32) within 0.03: one token clipped more or less moves it by
    # ~0.01 (the same update in bf16 on the CPU: -0.117 against -0.105)
    assert gpu["entropy"] == pytest.approx(cpu["entropy"], rel=1e-2), (cpu, gpu)
    assert gpu["imp_weight_mean"] == pytest.approx(cpu["imp_weight_mean"], rel=1e-2), (cpu, gpu)
    assert gpu["loss"] == pytest.approx(cpu["loss"], abs=3e-2), (cpu, gpu)
    assert gpu["train_tokens"] == cpu["train_tokens"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_head_and_chunked_logprobs_on_cuda_match_the_plain_computation(dtype: torch.dtype) -> None:
    from services.trainer.model.fused_head import head_logp_entropy
    from services.trainer.model.logprobs import lean_logp_entropy, logp_entropy_from_logits

    g = torch.Generator(device="cuda").manual_seed(0)
    b, t, d, v = 2, 300, 256, 5000
    hidden = (torch.randn(b, t, d, device="cuda", generator=g) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, device="cuda", generator=g) * 0.05).to(dtype).requires_grad_()
    ids = torch.randint(0, v, (b, t), device="cuda", generator=g)

    def grads(fn: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden.grad = weight.grad = None
        logp, ent = fn()  # type: ignore[operator]
        (logp.sum() + 0.1 * ent.sum()).backward()
        return logp.detach(), ent.detach(), hidden.grad.float(), weight.grad.float()

    plain = grads(lambda: logp_entropy_from_logits(hidden @ weight.T, ids, 0.8))
    chunked = grads(lambda: lean_logp_entropy(hidden @ weight.T, ids, 0.8, chunk_tokens=64))
    fused = grads(lambda: head_logp_entropy(hidden, weight, None, ids, 0.8, chunk_tokens=64))
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    for other in (chunked, fused):
        for a, c in zip(plain, other, strict=True):
            torch.testing.assert_close(c, a, **tol)


@pytest.mark.timeout(300)
def test_the_server_generates_on_cuda_with_the_models_own_logprobs(tiny_model: Path, tmp_path: Path) -> None:
    from tests.support.inference import reference_logprobs, running_servers

    with running_servers(tiny_model, tmp_path, 1, "device=cuda", "dtype=float32") as (server,):
        body = {"input_ids": [[1, 5, 6, 7]] * 3, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
                "return_logprob": True}
        outs = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
        info = httpx.get(f"{server.url}/server_info", timeout=10).json()
    assert info["device"] == "cuda"
    for out in outs:
        assert len(out["output_ids"]) == 24
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        want = reference_logprobs(tiny_model, [1, 5, 6, 7], out["output_ids"], 0.0)  # on the CPU, float32
        assert got == pytest.approx(want, abs=1e-3)


@pytest.mark.timeout(300)
def test_a_colocated_update_by_cuda_ipc_is_bit_exact_in_bf16(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from services.weights.sender.colocated import ColocatedSender
    from tests.support.inference import running_servers

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    state = {n: (p.detach() + 0.01).cuda() for n, p in model.named_parameters()}
    with running_servers(tiny_model, tmp_path, 1, "device=cuda", "dtype=bfloat16", "memory_fraction=0.3") as (server,):

        async def send() -> list[str]:
            sender = ColocatedSender([server.url], dtype="bfloat16", bucket_mb=0.05)
            try:
                for v in (1, 2):
                    result = await sender.send_version(v, {n: t + 0.01 * v for n, t in state.items()})
                    assert result.loaded == [server.url], result.failed
                return result.loaded
            finally:
                await sender.aclose()

        asyncio.run(send())
        for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"):
            served = httpx.post(f"{server.url}/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30},
                                timeout=30).json()
            want = (state[name] + 0.02).to(torch.bfloat16).float().cpu()
            assert torch.equal(torch.tensor(served, dtype=torch.float32), want), name
        gen = httpx.post(f"{server.url}/generate", json={"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 4}},
                         timeout=60).json()
        assert gen["meta_info"]["weight_version"] == "2"
