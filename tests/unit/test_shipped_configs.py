"""Every shipped config file parses: each section validates against its service's settings class."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from services.common.settings import ServiceSettings
from services.up import SERVICE_SECTIONS

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples").glob("*.yaml"))


def settings_class(name: str) -> type[ServiceSettings]:
    module = importlib.import_module(f"services.{name}.settings")
    return next(c for c in vars(module).values() if isinstance(c, type) and issubclass(c, ServiceSettings) and getattr(c, "service", None) == name)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_sections_validate(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    assert set(data) <= {"up", *SERVICE_SECTIONS}, f"unknown sections in {path.name}"
    for section, values in data.items():
        settings_class(section).model_validate(values or {})


def test_example_workflow_resolves() -> None:
    from services.rollout.workflow import resolve_workflow

    wf = resolve_workflow("examples.copy3:Copy3Workflow", {"tokenizer": object(), "reward": object(), "reward_fn": "examples.copy3:reward"})
    assert wf.group_size == 8


def test_example_reward() -> None:
    from examples.copy3 import reward

    assert reward(completion="123", completion_ids=[5, 6, 7, 2], answer="123") == 1.0
    assert reward(completion="129", completion_ids=[5, 6, 13], answer="123") == 0.5
