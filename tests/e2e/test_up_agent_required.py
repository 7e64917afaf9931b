"""The tool-using agent of examples/agent_tool_required.py trained in `jetrl up` with its example config
and nothing about launch flags: `up` starts the servers with their tokenizer because the workflow is an
agent (services/up/grammar.py), so `tool_choice="required"` is enforced while decoding. Every episode
gets one valid call (no failed episode, no 422), and every recorded completion, the tokens the trainer
trained on, decodes to a `submit` call whose arguments fit the tool's schema.

On the ASCII tiny model (two steps, CI-sized). `JETRL_TEST_REAL_AGENT=1` runs the same on
SmolLM2-135M-Instruct with examples/agent_tool_required_smollm2.yaml (minutes on a CPU; made by
`jetrl make-model`, cached under `JETRL_CACHE`)."""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas import metric_names as names
from schemas.headers import is_rejection
from schemas.trajectory import decode_group
from tests.support.up import ROOT, finish, left_behind, read_recording, start_up

SMALL = {"up": {"stop_at_reward": 0}, "rollout": {"group_size": 4, "max_concurrent": 8},
         "trainer": {"batch_groups": 2, "eta": 1, "checkpoint_every": 0, "feeder": {"max_in_flight": 4}}}


def recorded_calls(run_dir: Path, run: str, tokenizer: Any) -> list[dict[str, Any]]:
    """Each trained completion's tool call (the JSON object the grammar held it to)."""
    calls = []
    for headers, data in asyncio.run(read_recording(run_dir, run)):
        if is_rejection(headers):
            continue
        g = decode_group(data)
        for ids, mask in zip(g.tensors["input_ids"], g.tensors["loss_mask"], strict=True):
            text = tokenizer.decode(ids[mask == 1], skip_special_tokens=True)
            calls.append(json.loads(text[text.index("{"):text.rindex("}") + 1]))
    return calls


def run_example(tmp_path: Path, config: str, model: Path, overrides: dict[str, Any], steps: int) -> None:
    from services.common.settings import deep_merge

    run = "agent"
    (tmp_path / "model").symlink_to(model)
    proc = start_up(tmp_path, run, steps, deep_merge(yaml.safe_load((ROOT / "examples" / config).read_text()), overrides))
    out = finish(proc, timeout=1100)
    assert proc.returncode == 0 and f"step {steps}/{steps}" in out, out[-4000:]
    assert left_behind(tmp_path) == []
    run_dir = tmp_path / run
    outcomes = json.loads((run_dir / "metrics.json").read_text())["rollout_outcomes"]
    assert outcomes["episodes_failed_total"] == 0 and outcomes[names.CONSTRAINT_UNMET_TOTAL] == 0, outcomes
    from transformers import AutoTokenizer

    calls = recorded_calls(run_dir, run, AutoTokenizer.from_pretrained(model))
    assert len(calls) >= steps * 2 * 4  # every trained sample: batch_groups x group_size per step
    for call in calls:
        assert call["name"] == "submit" and set(call["arguments"]) == {"answer"}, call
        assert re.fullmatch(r"[0-9]{1,8}", call["arguments"]["answer"]), call
    print(out[out.rfind("run agent:"):], f"{len(calls)} recorded tool calls, all valid; outcomes {outcomes}", sep="\n")


@pytest.mark.timeout(1200)
def test_the_required_tool_agent_trains_in_up_with_only_valid_calls(tmp_path: Path, ascii_model: Path) -> None:
    run_example(tmp_path, "agent_tool_required.yaml", ascii_model, {**SMALL, "rollout": {**SMALL["rollout"], "max_new_tokens": 200}}, 2)


@pytest.mark.timeout(1200)
@pytest.mark.skipif(not os.environ.get("JETRL_TEST_REAL_AGENT"), reason="minutes on a CPU: set JETRL_TEST_REAL_AGENT=1")
def test_the_required_tool_agent_on_smollm2_in_up(tmp_path: Path) -> None:
    from services.inference.known_models import make_known_model

    model = make_known_model("smollm2-135m-instruct", cache=Path(os.environ.get("JETRL_CACHE") or ROOT / ".cache" / "jetrl"))
    run_example(tmp_path, "agent_tool_required_smollm2.yaml", model, {}, 3)
