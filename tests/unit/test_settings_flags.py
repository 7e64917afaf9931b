"""The one settings path every command takes: a mapping given in code sits where a config file does
(under the environment and the overrides), and the command-line flags a settings class declares on its
fields are spellings of those settings, in any order among `key=value` overrides."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.common.entry import parse_settings, read_command_line
from services.common.settings import Field, Section, ServiceSettings, SettingsError, flag, flags, load_settings
from services.up.settings import UpSettings


class Window(Section):
    start: int = Field(0, ge=0, json_schema_extra=flag("--start"))
    """First item."""
    follow: bool = Field(False, json_schema_extra=flag("--follow"))
    """Keep going."""


class FlagDemo(ServiceSettings):
    service = "flagdemo"
    total_steps: int = Field(10, ge=1, json_schema_extra=flag("--steps"))
    """Steps."""
    resume: str = Field("never", json_schema_extra=flag("--resume", bare="auto"))
    """Where to resume from."""
    name: str = "x"
    """A name."""
    window: Window = Window()
    """The window."""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("JETRL_FLAGDEMO__", "JETRL_UP__")):
            monkeypatch.delenv(key)


def _parse(*argv: str) -> FlagDemo:
    s = parse_settings(FlagDemo, list(argv), "jetrl flagdemo", "")
    assert isinstance(s, FlagDemo)
    return s


def test_flags_are_declared_on_the_fields() -> None:
    assert [(f.name, f.key, f.bare, f.switch) for f in flags(FlagDemo)] == [
        ("--steps", "total_steps", None, False), ("--resume", "resume", "auto", False),
        ("--start", "window.start", None, False), ("--follow", "window.follow", None, True)]


def test_a_flag_is_its_setting_in_any_position() -> None:
    s = _parse("name=a", "--steps", "7", "window.start=2", "--follow", "--resume")
    assert (s.name, s.total_steps, s.window.start, s.window.follow, s.resume) == ("a", 7, 2, True, "auto")
    s = _parse("--steps=8", "--start", "3", "--resume", "/ck/v3", "name=b")
    assert (s.total_steps, s.window.start, s.resume, s.name) == (8, 3, "/ck/v3", "b")
    assert _parse("total_steps=5", "--steps", "6").total_steps == 6  # the flag wins


def test_a_bad_flag_value_names_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse("--steps", "0")
    assert exc.value.code == 2 and "total_steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("--stepz", "3")


def test_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--help")
    out = capsys.readouterr().out
    assert "--steps VALUE" in out and "--follow" in out and "total_steps" in out


def test_a_mapping_sits_under_the_file_the_environment_and_the_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = {"name": "mapped", "total_steps": 3, "window": {"start": 4, "follow": True}}
    s = load_settings(FlagDemo, values=values)
    assert (s.name, s.total_steps, s.window.start, s.window.follow) == ("mapped", 3, 4, True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("window:\n  start: 5\n")
    monkeypatch.setenv("JETRL_FLAGDEMO__TOTAL_STEPS", "9")
    s = load_settings(FlagDemo, cfg, ["name=cli"], values=values)
    # file over mapping, env over both, overrides over all; untouched keys of a section survive
    assert (s.name, s.total_steps, s.window.start, s.window.follow) == ("cli", 9, 5, True)
    with pytest.raises(SettingsError, match="nmae: unknown key"):
        load_settings(FlagDemo, values={"nmae": "x"})


def test_jetrl_up_flags_and_config_section_take_the_same_path() -> None:
    line = read_command_line(UpSettings, ["--steps", "12", "run=exp", "--rollout-workers=3"], "jetrl up", "")
    s = load_settings(UpSettings, line.config, line.overrides, values={"total_steps": 99, "dataset_size": 8})
    assert (s.total_steps, s.rollout_workers, s.run, s.dataset_size) == (12, 3, "exp", 8)
