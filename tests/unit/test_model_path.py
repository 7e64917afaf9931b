"""`model_path` names: a directory as it is, a known name to the directory make-model wrote, a hub id
to its snapshot in the local Hugging Face cache (offline), and a clear error for what is not here."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.common.model_path import resolve_model_path
from services.inference.settings import InferenceSettings
from services.rollout.settings import RolloutSettings
from services.trainer.settings import TrainerSettings
from services.up.settings import UpSettings


def test_a_known_name_is_the_directory_make_model_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JETRL_CACHE", str(tmp_path))
    with pytest.raises(ValidationError, match="run `jetrl make-model smollm2-135m-instruct` first"):
        InferenceSettings(model_path="smollm2-135m-instruct")
    made = tmp_path / "models" / "smollm2-135m-instruct"
    made.mkdir(parents=True)
    (made / "config.json").write_text("{}")
    for settings in (InferenceSettings, RolloutSettings, TrainerSettings, UpSettings):
        assert settings(model_path="smollm2-135m-instruct").model_path == str(made)  # type: ignore[call-arg]


def test_a_hub_id_resolves_from_the_local_hf_cache_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValidationError, match=r"neither a directory here nor in the local Hugging Face cache.*"
                                              r"never downloads from a model hub.*jetrl make-model"):
        TrainerSettings(model_path="someorg/some-model")
    # a snapshot as huggingface_hub lays it out
    repo = tmp_path / "hub" / "models--someorg--some-model"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert Path(TrainerSettings(model_path="someorg/some-model").model_path) == snapshot


def test_a_directory_or_a_new_path_is_kept_as_given(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path(".jetrl/models/tiny") == ".jetrl/models/tiny"  # up builds the tiny model there
    assert resolve_model_path("/models/Qwen2.5-1.5B-Instruct") == "/models/Qwen2.5-1.5B-Instruct"
