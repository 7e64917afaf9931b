"""AReaL's own code, unchanged but for its imports, runs in jetrl. The pinned `areal` wheel
(`areal_pkg.py`) is the input: its workflow, reward and agent files are copied into a temporary
package with their import lines rewritten from docs/compat.md's import map (`port.py`), nothing else
edited, and run as `jetrl rollout` runs a workflow (built from settings, by the real rollout worker,
against nats-server and the CPU inference server with the tiny model). Each piece must give groups
with no failed and no rejected episode, and AReaL's `stats_tracker` scalars must reach the worker's
METRICS values. (The acceptance's 20 trained steps in `jetrl up`: test_areal_up.py.)"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

import jetrl
from schemas.headers import is_rejection
from schemas.messages import PromptTask, RejectionMarker, decode, encode
from schemas.subjects import Subjects
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import SGLangClient
from services.rollout.service import build_workflow, standard_kwargs
from services.rollout.settings import RolloutSettings
from tests.areal.areal_pkg import install
from tests.areal.port import import_map, imported_names, port
from tests.integration.test_rollout_stack import inference
from tests.support.rollout import collect, running_worker

RUN = "areal"
S = Subjects(RUN)
PACKAGE = "ported_areal"
FILES = ["workflow/rlvr.py", "workflow/multi_turn.py", "reward/__init__.py", "reward/gsm8k.py",
         "workflow/openai/math_agent.py", "workflow/anthropic/math_agent.py",
         "experimental/workflow/multi_turn_v2.py", "workflow/openai_agent/math_agent.py"]
"""AReaL's files the tier ports (paths under `areal/`). The direct-client pieces: AReaL's examples
(`gsm8k_rl_mt.py`, `openai-agents/`) are on no PyPI distribution, so the tier ports the wheel's own
direct-client multi-turn workflow (`experimental/workflow/multi_turn_v2.py`, the same episode through
`ArealOpenAI`) and the openai-agents agent those examples train (`workflow/openai_agent/math_agent.py`),
run through the direct client by `agents_direct.py` (docs/compat.md)."""
MAX_POSITIONS = 2048
"""The tiny model, with room for AReaL's openai-agents instructions (~1,400 characters: one token
each with the tiny model's character tokenizer; the default 512 positions would refuse them)."""

# What each piece is, as an AReaL config names it: workflow, workflow_kwargs.
PIECES: dict[str, tuple[str, dict[str, Any]]] = {
    "rlvr+gsm8k": (f"{PACKAGE}.workflow.rlvr.RLVRWorkflow", {"reward_fn": f"{PACKAGE}.reward.gsm8k.gsm8k_reward_fn"}),
    "multi_turn": (f"{PACKAGE}.workflow.multi_turn.MultiTurnWorkflow",
                   {"reward_fn": f"{PACKAGE}.reward.gsm8k.gsm8k_reward_fn", "max_turns": 2, "turn_discount": 0.9}),
    "openai-agent": (f"{PACKAGE}.workflow.openai.math_agent.MultiTurnMathAgent", {"max_turns": 2, "max_completion_tokens": 6}),
    "anthropic-agent": (f"{PACKAGE}.workflow.anthropic.math_agent.MathAgent", {"max_tokens": 6}),
    "direct-multi-turn": (f"{PACKAGE}.experimental.workflow.multi_turn_v2.MultiTurnWorkflow",
                          {"reward_fn": f"{PACKAGE}.reward.gsm8k.gsm8k_reward_fn", "max_turns": 2, "turn_discount": 0.9}),
    "openai-agents-direct": ("tests.areal.agents_direct:OpenAIAgentsWorkflow",
                             {"agent_builder_path": f"{PACKAGE}.workflow.openai_agent.math_agent.build_math_agent",
                              "reward_fn": f"{PACKAGE}.reward.gsm8k.gsm8k_reward_fn"}),
}
STATS = {piece: "rollout/reward" for piece in PIECES}
"""The `stats_tracker` scalar each piece records (for the proxy agents, the agent workflow records
it, as AReaL's proxy workflow does: AReaL's math agents record none of their own)."""


@pytest.fixture(scope="module")
def ported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    dest = port(install(), FILES, tmp_path_factory.mktemp("areal-port"), PACKAGE)
    sys.path.insert(0, str(dest))
    try:
        yield dest
    finally:
        sys.path.remove(str(dest))
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
            del sys.modules[name]
        jetrl.AsyncRewardWrapper.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.inference.make_model import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny", max_positions=MAX_POSITIONS)


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with inference(model, tmp_path_factory.mktemp("inf") / "server.log") as url:
        yield url


@pytest.fixture
async def engine(server: str) -> AsyncIterator[SGLangClient]:
    eng = SGLangClient(InferenceClientSettings(servers=[server]))
    try:
        yield eng
    finally:
        await eng.aclose()


def test_the_map_covers_every_areal_import_and_each_jetrl_name_exists(ported: Path) -> None:
    mapping = import_map()
    root = install() / "areal"
    for rel in FILES:
        for name in imported_names((root / rel).read_text()):
            assert name in mapping, f"areal/{rel} imports {name}, missing from docs/compat.md's import map"
    for areal_name, jetrl_name in mapping.items():
        module, _, attr = jetrl_name.rpartition(".")
        assert module.split(".")[0] == "jetrl", f"{areal_name} maps to {jetrl_name}, not a jetrl name"
        target = __import__(module, fromlist=[attr])
        assert hasattr(target, attr), f"{areal_name} -> {jetrl_name}: no such name"
    # the port changed import lines only: the rest of each file is AReaL's, line for line
    for rel in FILES:
        before, after = (root / rel).read_text(), (ported / PACKAGE / rel).read_text()
        assert without_imports(before) == without_imports(after), rel


class _DropImports(ast.NodeTransformer):
    def visit_Import(self, node: ast.Import) -> ast.Pass:
        return ast.Pass()

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.Pass:
        return ast.Pass()


def without_imports(source: str) -> str:
    """The code of `source` with every import statement (at any depth) replaced by `pass`."""
    return ast.dump(_DropImports().visit(ast.parse(source)))


def rows(n: int) -> list[dict[str, Any]]:
    """gsm8k-shaped rows (chat `messages`, `answer`; no `prompt` key, as AReaL's reward call passes one)."""
    return [{"id": f"q{i}", "answer": str(i + 2), "messages": [{"role": "user", "content": f"What is {i} + 2?"}]}
            for i in range(n)]


async def push(nc: NATS, data: list[dict[str, Any]]) -> None:
    js = nc.jetstream()
    for row in data:
        task = encode(PromptTask(run=RUN, prompt_id=row["id"], data=row))
        await js.publish(S.prompts_train, task, headers={"Nats-Msg-Id": f"{RUN}/prompt/{row['id']}"})


@pytest.mark.timeout(240)
@pytest.mark.parametrize("piece", list(PIECES))
async def test_areals_own_code_runs_episodes_with_none_failed(
    piece: str, ported: Path, nc: NATS, engine: SGLangClient, model: Path
) -> None:
    from transformers import AutoTokenizer

    workflow_ref, kwargs = PIECES[piece]
    settings = RolloutSettings(run=RUN, workflow=workflow_ref, workflow_kwargs=kwargs, group_size=2, max_new_tokens=6,
                               model_path=str(model))
    tok = AutoTokenizer.from_pretrained(model)
    workflow = build_workflow(settings, standard_kwargs(settings, lambda: tok, None))
    async with running_worker(nc, RUN, workflow, engine, nak_delay_s=0.1, max_deliver=1) as w:
        await push(nc, rows(3))
        msgs = await collect(nc.jetstream(), S.trajectories, 3, timeout_s=120)
        snapshot = w._snapshot()
    rejected = [decode(RejectionMarker, m.data).reason for m in msgs if is_rejection(m.headers)]
    assert len(msgs) == 3 and not rejected, rejected
    assert snapshot["episodes_failed_total"] == 0 and snapshot["accepted_total"] == 3
    assert STATS[piece] in snapshot, sorted(snapshot)  # recorded with stats_tracker
    if piece in ("multi_turn", "direct-multi-turn"):
        assert 1 <= snapshot["rollout/num_turns"] <= 2
    json.dumps(snapshot)  # METRICS-ready
