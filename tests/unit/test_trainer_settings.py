"""The trainer's command line: `--resume auto` is the setting, bad values are refused with the key named."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.common.entry import parse_settings
from services.common.settings import SettingsError, load_settings
from services.trainer.settings import TrainerSettings


def _parse(*argv: str) -> TrainerSettings:
    s = parse_settings(TrainerSettings, list(argv), "jetrl trainer", "")
    assert isinstance(s, TrainerSettings)
    return s


def test_resume_flag_becomes_the_setting() -> None:
    assert _parse("--resume", "auto", "run=x").resume == "auto"
    assert _parse("--resume=/ck/v3").resume == "/ck/v3"
    assert _parse("run=x", "--resume").resume == "auto"  # alone: auto
    s = _parse("--resume", "auto", "ppo.adv_norm=rloo", "zero_stage=3")
    assert s.resume == "auto" and s.ppo.adv_norm == "rloo" and s.zero_stage == 3
    assert _parse("run=x").resume == "never"


def test_invalid_settings_name_the_key() -> None:
    with pytest.raises(SettingsError, match="zero_stage"):
        load_settings(TrainerSettings, overrides=["zero_stage=4"])
    with pytest.raises(SettingsError, match=r"ppo\.loss_agg"):
        load_settings(TrainerSettings, overrides=["ppo.loss_agg=sum"])
    with pytest.raises(SettingsError, match="eval_dataset_path"):
        load_settings(TrainerSettings, overrides=["feeder.eval_every=5"])


def test_help_does_not_import_torch() -> None:
    code = "import sys; from services.trainer import main\ntry: main(['--help'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ppo.decoupled" in out.stdout and out.stdout.strip().endswith("False")
