"""Whether `jetrl up` starts its inference servers with their tokenizer.

SGLang started with `--skip-tokenizer-init` has no grammar backend: it aborts every request carrying
`json_schema`, `regex` or `ebnf` (SGLang's `GrammarManager`), and the CPU server does the same. Token
ids in and out is what the rollout engine needs (it decodes and applies stop strings itself), so `up`
skips the tokenizer, saving the detokenizing of every reply, unless the rollout workflow (or the eval
workflow) may send constraints: an agent, whose proxy turns `response_format` and `tool_choice`
required / named into grammars, or a workflow with `needs_grammar`. A workflow `up` cannot import here
keeps the tokenizer (constraints then work either way). The `inference:` section's own
`skip_tokenizer_init` wins over this choice.
"""

from __future__ import annotations

from typing import Any

from services.common.logging import get_logger
from services.rollout.resolve import needs_grammar
from services.rollout.settings import RolloutSettings
from services.rollout.workflow import WorkflowError

log = get_logger("up")


def skip_tokenizer_init(rollout: dict[str, Any]) -> bool:
    """`skip_tokenizer_init` for the servers of a run whose `rollout:` section is `rollout`."""
    default = RolloutSettings.model_fields["workflow"].default
    specs = [rollout.get("workflow") or default, rollout.get("eval_workflow") or ""]
    for spec in (s for s in specs if s):
        if not isinstance(spec, str):
            return False
        try:
            if needs_grammar(spec):
                log.info("inference servers keep their tokenizer: the workflow may send constrained requests", workflow=spec)
                return False
        except WorkflowError as exc:
            log.info("inference servers keep their tokenizer: the workflow does not import here", workflow=spec, error=str(exc))
            return False
    return True
