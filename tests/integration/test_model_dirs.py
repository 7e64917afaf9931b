"""jetrl never writes into a model directory it did not make: a sharded or `.bin` checkpoint given to
`jetrl up` (the path it takes: the pre-start check and the model step) or to `jetrl make-model` is
left byte-for-byte as it was; a directory jetrl made carries its marker and may be rebuilt."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import main as cli_main
from services.common.model_dirs import MARKER, NotOurs, check_model_dir
from services.inference.make_model import build_model
from services.up.run import _make_model

ROOT = Path(__file__).resolve().parents[2]


def hashes(root: Path) -> dict[str, str]:
    """Every file under `root` (names included: a file added or removed shows too) and its sha256."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def sharded(tiny_model: Path, tmp_path: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(out, max_shard_size="200KB")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    return out


@pytest.fixture
def bin_model(tiny_model: Path, tmp_path: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "bin"
    AutoConfig.from_pretrained(tiny_model).save_pretrained(out)
    torch.save(AutoModelForCausalLM.from_pretrained(tiny_model).state_dict(), out / "pytorch_model.bin")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", ["sharded", "bin_model"])
def test_up_uses_a_sharded_or_bin_model_as_it_is_and_writes_nothing(kind: str, request: pytest.FixtureRequest,
                                                                     monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("JETRL_CACHE", str(tmp_path / "cache"))  # make-model NAME's locks
    model: Path = request.getfixturevalue(kind)
    before = hashes(model)
    check_model_dir(model)  # `jetrl up`'s check before it starts anything: accepted
    _make_model(str(model))  # `jetrl up`'s model step (it used to write the tiny model over config and tokenizer)
    assert hashes(model) == before
    # make-model, even told to rebuild, refuses a directory it did not make, and says why
    with pytest.raises(NotOurs, match=f"{model}.*config.json.*jetrl never writes into it"):
        build_model(model, force=True)
    assert cli_main(["make-model", "--out", str(model), "--force"]) == 2
    assert cli_main(["make-model", "smollm2-135m-instruct", "--out", str(model)]) == 2  # refused before any download
    assert hashes(model) == before and not (model / MARKER).exists()


def test_the_server_serves_a_sharded_model_jetrl_did_not_make(sharded: Path) -> None:
    from services.inference.model_backend import TransformersBackend

    before = hashes(sharded)
    backend = TransformersBackend(str(sharded))
    assert backend.vocab_size == 48 and backend.decode_text(backend.tokenize("12=")) == "12="
    assert hashes(sharded) == before


def test_up_refuses_a_directory_that_is_not_a_model_and_starts_nothing(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine\n")
    before = hashes(notes)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "services.cli", "up", f"model_path={notes}", f"run_dir={tmp_path / 'runs'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"{notes} holds files that are not a model" in out.stderr and "only into a path that does not exist yet" in out.stderr
    assert hashes(notes) == before and not (tmp_path / "runs").exists()


def test_jetrl_writes_only_where_it_made_the_directory(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NotOurs, match="is empty and was not made by jetrl"):
        build_model(empty)
    assert not any(empty.iterdir())
    fresh = build_model(tmp_path / "fresh")
    assert (fresh / MARKER).is_file()
    stamp = (fresh / "model.safetensors").read_bytes()
    build_model(fresh, seed=3, force=True)  # its own directory: rebuilt on request
    assert (fresh / "model.safetensors").read_bytes() != stamp


def test_a_model_jetrl_made_by_name_is_never_replaced_by_the_tiny_one(sharded: Path, tmp_path: Path) -> None:
    import shutil

    from services.common.model_dirs import claim

    named = claim(tmp_path / "named")  # as make-model NAME leaves it: marked, sharded (no model.safetensors)
    for f in sharded.iterdir():
        shutil.copy2(f, named / f.name)
    before = hashes(named)
    _make_model(str(named))
    assert hashes(named) == before
