"""Which servers `jetrl up` starts with their tokenizer (services/up/grammar.py): SGLang and the CPU
server have no grammar backend with `skip_tokenizer_init`, so a run whose workflow may send constraints
(an agent; a workflow with `needs_grammar`) gets servers with their tokenizer, and any other run ids only."""

from __future__ import annotations

from typing import Any

from services.rollout.workflow import RolloutWorkflow
from services.up.grammar import skip_tokenizer_init


class GrammarWorkflow(RolloutWorkflow):
    needs_grammar = True

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> None:
        return None


def test_servers_keep_their_tokenizer_exactly_when_the_workflow_may_send_grammars() -> None:
    assert skip_tokenizer_init({}) is True  # the default RLVR workflow: token ids only
    assert skip_tokenizer_init({"workflow": "services.rollout.workflows.rlvr:RLVRWorkflow"}) is True
    assert skip_tokenizer_init({"workflow": "services.rollout.agent:AgentWorkflow"}) is False
    assert skip_tokenizer_init({"workflow": "examples.agent_tool_required:RequiredToolAgent"}) is False  # a bare agent
    assert skip_tokenizer_init({"workflow": f"{__name__}:GrammarWorkflow"}) is False
    assert skip_tokenizer_init({"eval_workflow": "examples.agent_tool_required:RequiredToolAgent"}) is False
    # a workflow up cannot import keeps the tokenizer (the rollout worker reports the import itself)
    assert skip_tokenizer_init({"workflow": "no_such_package.mod:Agent"}) is False
