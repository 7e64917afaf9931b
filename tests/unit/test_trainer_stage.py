"""`zero_stage: auto`: no ZeRO on one rank, ZeRO-2 on several, and a checkpoint resumes on the stage it
was written with (recorded beside it; ZeRO-2 where an older checkpoint has no record); an explicit
stage that contradicts the record is refused with both stages named."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.trainer.model import stage


def test_auto_is_no_zero_on_one_rank_and_zero_2_on_several() -> None:
    assert stage.resolve("auto", 1, None) == 0
    assert stage.resolve("auto", 4, None) == 2
    assert stage.resolve(3, 1, None) == 3


def test_a_checkpoint_resumes_on_its_recorded_stage(tmp_path: Path) -> None:
    tag = tmp_path / "checkpoints" / "v00000004"
    stage.record(tag, 0)
    assert stage.resolve("auto", 1, tag) == 0
    assert stage.resolve("auto", 2, tag) == 0  # the checkpoint decides, not the world size
    assert stage.resolve(0, 1, tag) == 0
    with pytest.raises(ValueError, match=r"zero_stage=2.*written with ZeRO stage 0.*zero_stage=0"):
        stage.resolve(2, 1, tag)


def test_an_unrecorded_checkpoint_resumes_on_zero_2_or_the_stage_set(tmp_path: Path) -> None:
    tag = tmp_path / "v00000002"
    tag.mkdir()
    assert stage.resolve("auto", 1, tag) == 2
    assert stage.resolve(3, 1, tag) == 3


def test_a_garbled_record_is_named(tmp_path: Path) -> None:
    (tmp_path / stage.STAGE_FILE).write_text("two\n")
    with pytest.raises(ValueError, match=r"jetrl_zero_stage: a ZeRO stage \(0-3\) expected, found 'two'"):
        stage.resolve("auto", 1, tmp_path)
