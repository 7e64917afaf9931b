"""Every shipped config file parses: each section validates against its service's settings class."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.up import SERVICE_SECTIONS
from services.up.stack import settings_class

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_sections_validate(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    assert set(data) <= {"up", *SERVICE_SECTIONS}, f"unknown sections in {path.name}"
    for section, values in data.items():
        values = dict(values or {})
        if "/" not in str(values.get("model_path", "/")):  # a model name: resolved only where `jetrl make-model` made it
            values["model_path"] = str(ROOT / "unused")
        if section == "trainer" and str((data.get("up") or {}).get("dataset_path", "")).startswith("task:"):
            # `jetrl up` generates a task's eval set and sets its path (services/up/run.py)
            values["feeder"] = {"eval_dataset_path": "generated.jsonl", **values.get("feeder", {})}
        settings_class(section).model_validate(values)


def test_example_workflow_resolves() -> None:
    from services.rollout.resolve import resolve_workflow

    wf = resolve_workflow("examples.copy3:Copy3Workflow", {"tokenizer": object(), "reward": object(), "reward_fn": "examples.copy3:reward"})
    assert wf.group_size == 8


def test_example_reward() -> None:
    from examples.copy3 import reward

    assert reward(completion="123", completion_ids=[5, 6, 7, 2], answer="123") == 1.0
    assert reward(completion="129", completion_ids=[5, 6, 13], answer="123") == 0.5


def test_up_passes_sections_as_env_that_parse_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `jetrl up` hands a service as environment variables gives back the same settings."""
    from services.common.settings import load_settings
    from services.up.stack import to_env

    values = {
        "run": "envcheck",
        "workflow_kwargs": {"max_new_tokens": 4, "style": {"a": [1, 2]}},
        "inference": {"servers": ["http://127.0.0.1:1", "http://127.0.0.1:2"]},
        "max_concurrent": 7,
        "dump_dir": None,
    }
    for key, value in to_env("rollout", values).items():
        monkeypatch.setenv(key, value)
    s = load_settings(settings_class("rollout"))
    assert s.workflow_kwargs == {"max_new_tokens": 4, "style": {"a": [1, 2]}}
    assert s.inference.servers == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert (s.max_concurrent, s.dump_dir, s.run) == (7, None, "envcheck")
