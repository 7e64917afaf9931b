"""Settings precedence (defaults < YAML < env < CLI) and unknown keys as errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.common.settings import Section, ServiceSettings, SettingsError, load_settings, parse_overrides


class Optim(Section):
    lr: float = 1e-3
    """Learning rate."""
    betas: list[float] = [0.9, 0.999]  # noqa: RUF012 - a pydantic field, copied per instance
    """Adam betas."""


class DemoSettings(ServiceSettings):
    service = "demo"
    batch: int = 16
    """Groups per step."""
    name: str = "x"
    """A name."""
    optim: Optim = Optim()
    """Optimizer."""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("JETRL_DEMO__"):
            monkeypatch.delenv(key)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = load_settings(DemoSettings)
    assert (s.batch, s.optim.lr, s.run) == (16, 1e-3, "default")


def test_yaml_beats_defaults_env_beats_yaml_cli_beats_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write(tmp_path, "batch: 8\nname: from-yaml\noptim:\n  lr: 0.5\n  betas: [0.1, 0.2]\n")
    s = load_settings(DemoSettings, cfg)
    assert (s.batch, s.name, s.optim.lr, s.optim.betas) == (8, "from-yaml", 0.5, [0.1, 0.2])

    monkeypatch.setenv("JETRL_DEMO__BATCH", "4")
    monkeypatch.setenv("JETRL_DEMO__OPTIM__LR", "0.25")
    s = load_settings(DemoSettings, cfg)
    # env wins per key; the YAML's other keys in the same section survive (deep merge)
    assert (s.batch, s.name, s.optim.lr, s.optim.betas) == (4, "from-yaml", 0.25, [0.1, 0.2])

    s = load_settings(DemoSettings, cfg, ["batch=2", "optim.lr=1e-5", "run=exp-1"])
    assert (s.batch, s.optim.lr, s.run, s.name) == (2, 1e-5, "exp-1", "from-yaml")


def test_yaml_section_named_after_the_service(tmp_path: Path) -> None:
    cfg = write(tmp_path, "demo:\n  batch: 3\nother:\n  ignored: true\n")
    assert load_settings(DemoSettings, cfg).batch == 3


def test_unknown_yaml_key_is_an_error(tmp_path: Path) -> None:
    cfg = write(tmp_path, "batchh: 8\n")
    with pytest.raises(SettingsError, match="batchh: unknown key"):
        load_settings(DemoSettings, cfg)


def test_unknown_nested_key_is_an_error() -> None:
    with pytest.raises(SettingsError, match=r"optim\.lrr: unknown key"):
        load_settings(DemoSettings, overrides=["optim.lrr=1"])


def test_unknown_env_key_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JETRL_DEMO__BACTH", "4")
    with pytest.raises(SettingsError, match="JETRL_DEMO__BACTH"):
        load_settings(DemoSettings)


def test_bad_value_names_key_and_value() -> None:
    with pytest.raises(SettingsError, match=r"batch: .*\(got 'many'\)"):
        load_settings(DemoSettings, overrides=["batch=many"])


def test_run_must_be_a_subject_token() -> None:
    with pytest.raises(SettingsError, match="run"):
        load_settings(DemoSettings, overrides=["run=a.b"])


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="no such file"):
        load_settings(DemoSettings, tmp_path / "nope.yaml")


def test_override_syntax() -> None:
    assert parse_overrides(["a.b=1", "c=x y", "d=[1, 2]", "e="]) == {"a": {"b": 1}, "c": "x y", "d": [1, 2], "e": ""}
    with pytest.raises(SettingsError, match="expected key=value"):
        parse_overrides(["novalue"])


def test_settings_are_frozen() -> None:
    s = load_settings(DemoSettings)
    with pytest.raises(ValidationError, match="frozen"):
        s.batch = 3  # type: ignore[misc]
