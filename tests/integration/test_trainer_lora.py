"""LoRA through peft: only the adapters train (the base weights stay as loaded, the optimizer holds
the adapters alone), the published weights are the merged full weights under the base model's names
(what peft's own merge gives), and in the real stack a trainer process publishes them and a real CPU
inference server loads them through a weights agent, each version a low-rank step from the base."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
import pytest
import torch

from schemas.messages import PromptTask, WeightsLoaded, decode
from schemas.subjects import WEIGHT_SYNC_STREAM, Subjects
from services.common.bus import connect
from services.trainer.intake.batch import collate, shard
from services.trainer.model.actor import PPOActor
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from tests.support.inference import free_port
from tests.support.trainer import (
    SERVICE_RUN,
    kill_group,
    make_group,
    publish_group,
    read_steps,
    start_trainer,
    take_prompts,
    until,
    write_dataset,
)
from tests.support.updates import uneven_groups
from tests.support.weights import process, wait_healthy

LORA = {"enabled": True, "rank": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]}


def _base(tiny_model: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_only_the_adapters_train_and_the_merged_weights_are_published(tiny_model: Path, tmp_path: Path, stage: int) -> None:
    from transformers import AutoModelForCausalLM

    s = TrainerSettings(model_path=str(tiny_model), zero_stage=stage, lr=1e-2, lora=LORA, ppo={"kl_coef": 0.05})
    engine = TrainEngine(s)
    actor = PPOActor(engine, s.ppo)
    trainable = {n for n, p in engine.engine.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert engine.ref_model is not None and list(engine.ref_model.parameters()) == []  # adapters off: no copy
    before = engine.full_state_dict() or {}
    base = _base(tiny_model)
    assert before.keys() == base.keys() and all(torch.equal(before[n], base[n]) for n in base)  # B starts at 0

    for _ in range(2):
        stats = actor.ppo_update(shard(actor.compute_advantages(collate(uneven_groups(tiny_model))), 1, 1)[0])
    assert stats["kl"] > 0  # the reference (adapters off) differs from the trained model now

    after = engine.full_state_dict() or {}
    changed = {n for n in base if not torch.equal(after[n], base[n])}
    assert changed == {n for n in base if n.endswith(("q_proj.weight", "v_proj.weight"))}
    for name in changed:  # a rank-2 step from the base weights
        assert torch.linalg.matrix_rank(after[name] - base[name]).item() <= 2, name

    # the same numbers as peft's own merge
    peft_model = engine.engine.module
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(peft_model.parameters())):
            merged = {n: p.detach().clone() for n, p in peft_model.merge_and_unload().named_parameters()}
    else:
        merged = {n: p.detach().clone() for n, p in peft_model.merge_and_unload().named_parameters()}
    for name in base:
        assert torch.allclose(after[name], merged[name], atol=1e-6), name

    out = engine.upload_weights(tmp_path / "w")
    assert out is not None and not (out / "adapter_config.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for name, p in reloaded.named_parameters():
        assert torch.equal(p, after[name]), name


def test_a_target_that_is_not_a_linear_layer_is_refused_by_name(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match=r"embed_tokens is a .*only linear layers are supported"):
        TrainEngine(TrainerSettings(model_path=str(tiny_model), lora={**LORA, "target_modules": ["embed_tokens"]}))


def _served(url: str, name: str) -> torch.Tensor:
    body = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30}, timeout=30).json()
    return torch.tensor(body, dtype=torch.float32)


@pytest.mark.timeout(420)
async def test_a_lora_trainer_publishes_weights_a_server_loads(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_args = ["-m", "services.inference", f"model_path={tiny_model}", f"port={port}", f"run={SERVICE_RUN}"]
    agent_args = ["-m", "services.weights", f"server={url}", f"nats_url={nats_url}", f"run={SERVICE_RUN}",
                  f"cache_dir={tmp_path / 'cache'}", "keep_local=1"]
    out = tmp_path / "trainer"
    out.mkdir()
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    subjects = Subjects(SERVICE_RUN)
    base = _base(tiny_model)
    with process(server_args, tmp_path / "server.log") as server, process(agent_args, tmp_path / "agent.log"):
        await wait_healthy(url, server, tmp_path / "server.log")
        proc = start_trainer(nats_url, tiny_model, out, "feeder.enabled=true", "feeder.max_in_flight=2",
                             f"feeder.dataset_path={write_dataset(tmp_path / 'd.jsonl', 20)}", "total_steps=2",
                             "checkpoint_every=0", "weights.transport=store", "lr=1e-2", "lora.enabled=true", "lora.rank=2",
                             "lora.alpha=4", 'lora.target_modules=["q_proj","v_proj"]')
        try:
            await until("the trainer to start", lambda: any(r.get("event") == "start" for r in read_steps(out)), 180, proc)
            loaded = await js.subscribe(subjects.weights_loaded(url), stream=WEIGHT_SYNC_STREAM, ordered_consumer=True)
            for step in (1, 2):  # act as the rollout side for the two steps
                tasks: list[PromptTask] = []
                while len(tasks) < 2:
                    with contextlib.suppress(TimeoutError):
                        tasks += await take_prompts(js, subjects.prompts_train, subjects.rollout_consumer, 2 - len(tasks))
                    if proc.poll() is not None:
                        raise RuntimeError(f"trainer exited with {proc.returncode} before step {step}")
                for i, t in enumerate(tasks):
                    await publish_group(js, SERVICE_RUN, t.prompt_id, make_group(tiny_model, t.data["answer"], seed=step * 10 + i))
            assert await asyncio.to_thread(proc.wait, 180) == 0
            while True:  # the agent's reports, up to version 2 (the last)
                report = decode(WeightsLoaded, (await loaded.next_msg(timeout=120)).data)
                if report.version == 2:
                    break
        finally:
            kill_group(proc)
            await nc.close()
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight"):
            step = _served(url, name) - base[name]
            assert step.abs().max() > 0 and torch.linalg.matrix_rank(step).item() <= 2, name  # merged rank-2 update
        for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"):
            assert torch.equal(_served(url, name), base[name]), name  # the frozen base, as it was
