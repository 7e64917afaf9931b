"""The agent proxy against the real CPU inference server, driven by the real `openai` (AsyncOpenAI,
and the sync OpenAI in subprocess mode) and `anthropic` SDKs: the exported tokens, logprobs and
versions are exactly the engine's; parents across a 3-turn and a branching conversation; discounted
rewards; `concat` on a linear conversation and its refusal on a branching one; API-shaped 4xx errors."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from services.rollout.agent.proxy import AgentProxy, SamplingDefaults
from services.rollout.agent.server import ProxyServer
from services.rollout.agent.workflow import AgentWorkflow
from services.rollout.engine import ModelResponse
from services.rollout.workflow import as_tensor_dict
from tests.support import agent
from tests.support.agent import ROOT, RecordingEngine

# fixtures: the module's inference server and the recording engine
inference_url, engine = agent.inference_url, agent.engine


@pytest.fixture
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
async def server(engine: RecordingEngine, tokenizer: Any) -> AsyncIterator[ProxyServer]:
    async with agent.running(AgentProxy(engine, tokenizer, SamplingDefaults(max_new_tokens=6))) as srv:
        yield srv


async def start(http: httpx.AsyncClient, srv: ProxyServer) -> str:
    return await agent.session(http, srv, "t")


async def three_turns(client: openai.AsyncOpenAI) -> list[Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "123="}]
    out = []
    for follow in ("again:", "last:", None):
        resp = await client.chat.completions.create(model="policy", messages=messages)
        out.append(resp)
        if follow:
            messages += [resp.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": follow}]
    return out


def engine_sample(calls: list[ModelResponse]) -> tuple[list[int], list[float], list[int]]:
    """The last call's whole sequence, and the logprobs / versions of every generated token in it."""
    last = calls[-1]
    logp: list[float] = []
    vers: list[int] = []
    for c in calls:
        logp += c.output_logprobs
        vers += c.output_versions
    return last.input_ids + last.output_ids, logp, vers


async def test_three_turn_openai_conversation_exports_the_engines_exact_tokens(server: ProxyServer, engine: RecordingEngine) -> None:
    async with httpx.AsyncClient() as http:
        # concat: the whole conversation is one sample whose tokens are the engine's
        sid = await start(http, server)
        client = openai.AsyncOpenAI(base_url=server.base_url(sid), api_key="x", http_client=http)
        replies = await three_turns(client)
        cache = server.proxy.sessions[sid].cache
        a, b, c = (cache.get(r.id) for r in replies)
        assert a.parent is None and b.parent is a and c.parent is b
        assert b.prompt_ids[: len(a.full_ids)] == a.full_ids and c.prompt_ids[: len(b.full_ids)] == b.full_ids
        assert (await http.post(f"{server.url}/{sid}/rl/set_reward", json={"reward": 1.0})).json()["interaction_id"] == c.id
        resp = await http.post(f"{server.url}/export_trajectories", json={"session_id": sid, "discount": 0.9, "style": "concat"})
        assert resp.status_code == 200
        [(leaf, row)] = resp.json()["interactions"].items()
        ids, logp, vers = engine_sample(engine.calls)
        gen = [i for i, m in enumerate(row["loss_mask"]) if m]
        assert leaf == c.id and row["input_ids"] == ids and row["reward"] == 1.0
        assert [row["logprobs"][i] for i in gen] == pytest.approx(logp, abs=0) and [row["versions"][i] for i in gen] == vers
        assert replies[0].choices[0].message.content == server.proxy.chat.decode(engine.calls[0].output_ids)

        # individual: every completion, the final reward discounted back 0.9 per turn
        engine.calls.clear()
        sid = await start(http, server)
        client = openai.AsyncOpenAI(base_url=server.base_url(sid), api_key="x", http_client=http)
        replies = await three_turns(client)
        await http.post(f"{server.url}/{sid}/rl/set_reward", json={"interaction_id": replies[-1].id, "reward": 1.0})
        rows = (await http.post(f"{server.url}/export_trajectories", json={"session_id": sid, "discount": 0.9})).json()["interactions"]
        assert [rows[r.id]["reward"] for r in replies] == pytest.approx([0.81, 0.9, 1.0])
        for r, call in zip(replies, engine.calls, strict=True):
            assert rows[r.id]["input_ids"] == call.input_ids + call.output_ids
            assert rows[r.id]["logprobs"][len(call.input_ids):] == call.output_logprobs
        assert (await http.post(f"{server.url}/export_trajectories", json={"session_id": sid})).status_code == 404  # exported once


async def test_branching_conversation_exports_individually_and_concat_is_refused(server: ProxyServer) -> None:
    async with httpx.AsyncClient() as http:
        sid = await start(http, server)
        client = openai.AsyncOpenAI(base_url=server.base_url(sid), api_key="x", http_client=http)
        first = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "42="}])
        history = [{"role": "user", "content": "42="}, first.choices[0].message.model_dump(exclude_none=True)]
        left = await client.chat.completions.create(model="p", messages=[*history, {"role": "user", "content": "left"}])
        right = await client.chat.completions.create(model="p", messages=[*history, {"role": "user", "content": "right"}])
        cache = server.proxy.sessions[sid].cache
        assert cache.get(left.id).parent is cache.get(first.id) and cache.get(right.id).parent is cache.get(first.id)
        await http.post(f"{server.url}/{sid}/rl/set_reward", json={"interaction_id": left.id, "reward": 1.0})
        refused = await http.post(f"{server.url}/export_trajectories", json={"session_id": sid, "style": "concat"})
        assert refused.status_code == 400 and "branches into 2 continuations" in refused.json()["error"]["message"]
        rows = (await http.post(f"{server.url}/export_trajectories", json={"session_id": sid, "discount": 0.5})).json()["interactions"]
        assert {k: v["reward"] for k, v in rows.items()} == pytest.approx({first.id: 0.25, left.id: 1.0, right.id: 0.0})


async def test_responses_and_anthropic_messages_record_the_same_way(server: ProxyServer, engine: RecordingEngine) -> None:
    async with httpx.AsyncClient() as http:
        sid = await start(http, server)
        client = openai.AsyncOpenAI(base_url=server.base_url(sid), api_key="x", http_client=http)
        r1 = await client.responses.create(model="p", input="7=", max_output_tokens=3)
        r2 = await client.responses.create(model="p", input="more", previous_response_id=r1.id)
        claude = anthropic.AsyncAnthropic(base_url=f"{server.url}/{sid}", api_key="x")
        m1 = await claude.messages.create(model="p", max_tokens=4, messages=[{"role": "user", "content": "8="}])
        m2 = await claude.messages.create(model="p", max_tokens=4, messages=[
            {"role": "user", "content": "8="}, {"role": "assistant", "content": m1.content[0].text}, {"role": "user", "content": "ok"}])
        assert r1.status in ("completed", "incomplete") and len(engine.calls[0].output_ids) <= 3
        assert r1.output_text == server.proxy.chat.decode(engine.calls[0].output_ids)
        assert m1.usage.output_tokens == len(engine.calls[2].output_ids) and m1.stop_reason in ("end_turn", "max_tokens")
        cache = server.proxy.sessions[sid].cache
        assert cache.get(r2.id).parent is cache.get(r1.id) and cache.get(m2.id).parent is cache.get(m1.id)
        await http.post(f"{server.url}/{sid}/rl/set_reward", json={"interaction_id": r2.id, "reward": 1.0})
        await http.post(f"{server.url}/{sid}/rl/set_reward", json={"reward": 0.5})  # the last completion: m2
        rows = (await http.post(f"{server.url}/export_trajectories", json={"session_id": sid, "style": "concat"})).json()["interactions"]
        assert rows.keys() == {r2.id, m2.id}
        for leaf, call in ((r2.id, engine.calls[1]), (m2.id, engine.calls[3])):
            assert rows[leaf]["input_ids"] == call.input_ids + call.output_ids


async def test_unknown_sessions_and_malformed_bodies_get_api_shaped_4xx(server: ProxyServer) -> None:
    async with httpx.AsyncClient() as http:
        ghost = openai.AsyncOpenAI(base_url=server.base_url("ghost"), api_key="x", http_client=http, max_retries=0)
        with pytest.raises(openai.NotFoundError) as err:
            await ghost.chat.completions.create(model="p", messages=[{"role": "user", "content": "1="}])
        assert err.value.code == "session_not_found" and "ghost" in err.value.message
        with pytest.raises(anthropic.NotFoundError, match="unknown session"):
            await anthropic.AsyncAnthropic(base_url=f"{server.url}/ghost", api_key="x", max_retries=0).messages.create(
                model="p", max_tokens=2, messages=[{"role": "user", "content": "1="}])
        sid = await start(http, server)
        client = openai.AsyncOpenAI(base_url=server.base_url(sid), api_key="x", http_client=http, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
            await client.chat.completions.create(model="p", messages=[])
        bad_json = await http.post(
            f"{server.url}/{sid}/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
        no_reward = await http.post(f"{server.url}/{sid}/rl/set_reward", json={"interaction_id": "chatcmpl-nope", "reward": 1})
        assert no_reward.status_code == 404 and no_reward.json()["error"]["code"] == "interaction_not_found"
        assert (await http.post(f"{server.url}/{sid}/rl/set_reward", json={"reward": "high"})).status_code == 400
        assert (await http.post(f"{server.url}/{sid}/rl/end_session")).status_code == 200
        with pytest.raises(openai.ConflictError, match="has ended"):
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "1="}])
        wrong = await http.post(f"{server.url}/export_trajectories", json={"session_id": sid, "style": "zigzag"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "style"
        assert (await http.get(f"{server.url}/{sid}/v1/nothing")).json()["error"]["code"] == "unknown_route"


class DictRewardAgent:
    """Rewards every completion itself (a dict of completion id -> reward)."""

    async def run(self, data: dict[str, Any], base_url: str, http_client: Any, **_: Any) -> dict[str, float]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="x", http_client=http_client)
        a = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": data["prompt"]}])
        b = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": data["prompt"]}])
        return {a.id: 0.25, b.id: 0.75}


async def test_inline_agent_workflow_returns_the_engines_tokens_as_a_tensor_dict(engine: RecordingEngine, tokenizer: Any) -> None:
    workflow = AgentWorkflow("examples.agent_tool_use:ToolUseAgent", tokenizer=tokenizer, discount=0.9,
                             agent_kwargs={"max_turns": 3, "max_tokens": 4})
    try:
        samples = await workflow.arun_episode(engine, {"prompt": "123=", "answer": "123"})
        assert samples is not None and len(samples) == len(engine.calls) >= 1
        tensors = as_tensor_dict(samples)
        for row, call in enumerate(engine.calls):
            n = len(call.input_ids) + len(call.output_ids)
            assert tensors["input_ids"][row, :n].tolist() == call.input_ids + call.output_ids
            assert tensors["logprobs"][row, len(call.input_ids):n].tolist() == pytest.approx(call.output_logprobs)
        answer = tokenizer.decode(engine.calls[-1].output_ids, skip_special_tokens=True)
        final = sum(a == b for a, b in zip(answer, "123", strict=False)) / 3
        assert tensors["rewards"][-1].item() == pytest.approx(final)
        engine.calls.clear()
        dict_workflow = AgentWorkflow(DictRewardAgent(), tokenizer=tokenizer)
        tensors = as_tensor_dict(await dict_workflow.arun_episode(engine, {"prompt": "5="}))
        assert tensors["rewards"].tolist() == [0.25, 0.75]  # siblings: no discount between them
        await dict_workflow.aclose()
    finally:
        await workflow.aclose()


async def test_subprocess_mode_runs_a_synchronous_openai_agent(engine: RecordingEngine, tokenizer: Any) -> None:
    workflow = AgentWorkflow("examples.agent_tool_use:SyncToolUseAgent", tokenizer=tokenizer, mode="subprocess", max_workers=1,
                             discount=0.5, export_style="concat", agent_kwargs={"max_turns": 2, "max_tokens": 3}, timeout_s=120)
    try:
        samples = await workflow.arun_episode(engine, {"prompt": "9=", "answer": "9"})
        assert samples is not None and len(samples) == 1
        [sample] = samples.values()
        ids, logp, vers = engine_sample(engine.calls)
        row = sample.as_json()
        gen = [i for i, m in enumerate(row["loss_mask"]) if m]
        assert row["input_ids"] == ids and [row["logprobs"][i] for i in gen] == logp and [row["versions"][i] for i in gen] == vers
        assert workflow.proxy is not None and not workflow.proxy.sessions  # the session is gone after export
    finally:
        await workflow.aclose()


async def test_rollout_worker_process_trains_on_the_example_agent(
    nats_url: str, inference_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    """`jetrl rollout` with examples/agent_tool_use.yaml's rollout section: one trajectory message per
    prompt, holding every completion of every episode of the group, tokens and versions from the engine."""
    import nats
    import yaml

    from schemas.headers import is_rejection
    from schemas.trajectory import decode_group
    from services.common.bus import declare_streams
    from tests.support.rollout import RUN, S, collect, push_prompts

    section = yaml.safe_load((ROOT / "examples" / "agent_tool_use.yaml").read_text())["rollout"]
    section.update(run=RUN, nats_url=nats_url, model_path=str(tiny_model), group_size=2, worker="agent-w",
                   inference={"servers": [inference_url]})
    config = tmp_path / "rollout.yaml"
    config.write_text(yaml.safe_dump(section))
    nc = await nats.connect(nats_url)
    log = tmp_path / "rollout.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.rollout", "--config", str(config)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        js = nc.jetstream()
        await declare_streams(js)
        await push_prompts(js, 2)
        got = await collect(js, S.trajectories, 2, timeout_s=90)
        assert len(got) == 2, log.read_text()[-3000:]
        for msg in got:
            assert not is_rejection(msg.headers), msg.headers
            group = decode_group(msg.data)
            t = group.tensors
            assert t["input_ids"].shape[0] >= 2  # at least one completion per episode, two episodes
            gen = t["loss_mask"] == 1
            assert gen.any(axis=1).all() and (t["versions"][gen] == 0).all() and (t["logprobs"][gen] < 0).all()
            context = (t["attention_mask"] == 1) & ~gen  # prompts, tool results, feedback: not trained on
            assert (t["versions"][context] == -1).all() and group.meta.worker == "agent-w"
    finally:
        proc.kill()
        proc.wait(10)
        await nc.close()
