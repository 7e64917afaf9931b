"""`model_path` names: a directory as it is, a known name to the directory make-model wrote, a hub id
to its snapshot in the local Hugging Face cache (offline), and a clear error for what is not here."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.model_path import ModelNotFound, require_model, resolve_model_path
from services.inference.settings import InferenceSettings
from services.rollout.settings import RolloutSettings
from services.trainer.settings import TrainerSettings
from services.up.settings import UpSettings


def test_a_known_name_is_the_directory_make_model_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JETRL_CACHE", str(tmp_path))
    # not made yet: a config naming it is still valid; loading it says what to do
    assert InferenceSettings(model_path="smollm2-135m-instruct").model_path == "smollm2-135m-instruct"
    with pytest.raises(ModelNotFound, match="run `jetrl make-model smollm2-135m-instruct` first"):
        require_model("smollm2-135m-instruct")
    made = tmp_path / "models" / "smollm2-135m-instruct"
    made.mkdir(parents=True)
    (made / "config.json").write_text("{}")
    for settings in (InferenceSettings, RolloutSettings, TrainerSettings, UpSettings):
        assert settings(model_path="smollm2-135m-instruct").model_path == str(made)  # type: ignore[call-arg]


def test_a_hub_id_resolves_from_the_local_hf_cache_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert TrainerSettings(model_path="someorg/some-model").model_path == "someorg/some-model"
    with pytest.raises(ModelNotFound, match=r"neither a directory here nor in the local Hugging Face cache.*"
                                            r"never downloads from a model hub.*jetrl make-model"):
        require_model("someorg/some-model")
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


def test_up_and_the_services_refuse_a_model_this_machine_does_not_have(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "JETRL_CACHE": str(tmp_path / "cache"), "HF_HUB_CACHE": str(tmp_path / "hub")}
    for name, says in [("smollm2-135m-instruct", "run `jetrl make-model smollm2-135m-instruct` first"),
                       ("someorg/some-model", "never downloads from a model hub")]:
        out = subprocess.run([sys.executable, "-m", "services.cli", "up", f"model_path={name}", f"run_dir={tmp_path / 'runs'}"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and says in out.stderr, out.stderr
    assert not (tmp_path / "runs").exists()  # nothing started
    from services.rollout.tokenizer import load_pretrained_tokenizer

    with pytest.raises(ModelNotFound, match="'someorg/not-cached-anywhere' is neither a directory here"):
        load_pretrained_tokenizer("someorg/not-cached-anywhere")  # the rollout worker's tokenizer
