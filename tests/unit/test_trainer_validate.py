"""Checking a group before training: each hostile kind is refused under its cause (lengths that
disagree with the metadata before anything is allocated), and the intake's transaction: a group
accepted but not yet trained is neither `trained` nor saved, and a copy of it meanwhile is a duplicate."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.headers import trajectory_headers
from schemas.trajectory import TrajectoryError, decode_group, encode_group_with_meta, encode_table, group_to_table
from services.trainer.intake.intake import Intake
from services.trainer.intake.validate import Limits, check_group
from services.trainer.versions import VersionWindow

LIMITS = Limits(vocab_size=20, max_seq_len=16)


def _tensors(n: int = 3, length: int = 6) -> dict[str, np.ndarray]:
    ids = np.tile(np.arange(1, length + 1, dtype=np.int64) % 20, (n, 1))
    loss_mask = np.zeros_like(ids)
    loss_mask[:, 3:] = 1
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": loss_mask,
            "logprobs": np.where(loss_mask > 0, -1.0, 0.0).astype(np.float32), "rewards": np.arange(n, dtype=np.float32),
            "versions": np.where(loss_mask > 0, 0, -1).astype(np.int64)}


def _message(tensors: dict[str, np.ndarray], prompt_id: str = "p") -> tuple[bytes, dict[str, str]]:
    body, meta = encode_group_with_meta(tensors, run="r", prompt_id=prompt_id, worker="w7")
    return body, trajectory_headers(meta)


def test_a_good_group_passes() -> None:
    assert check_group(_tensors(), LIMITS) is None


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        (lambda t: t["input_ids"].__setitem__((0, 2), 20), "oov_token"),
        (lambda t: t["input_ids"].__setitem__((1, 1), -1), "oov_token"),
        (lambda t: t["rewards"].__setitem__(1, np.nan), "non_finite"),
        (lambda t: t["logprobs"].__setitem__((2, 4), -np.inf), "non_finite"),
        (lambda t: t["rewards"].__setitem__(1, 3e38), "out_of_bounds"),
        (lambda t: t["rewards"].__setitem__(1, -2e6), "out_of_bounds"),
        (lambda t: t["logprobs"].__setitem__((2, 4), -3e38), "out_of_bounds"),
        (lambda t: t["logprobs"].__setitem__((2, 4), 0.5), "out_of_bounds"),
    ],
)
def test_each_bad_value_is_refused_under_its_cause(change: object, cause: str) -> None:
    t = _tensors()
    change(t)  # type: ignore[operator]
    problem = check_group(t, LIMITS)
    assert problem is not None and problem.cause == cause


def test_rows_longer_than_max_seq_len_are_refused_by_the_decoder_and_the_check() -> None:
    t = _tensors(length=17)
    with pytest.raises(TrajectoryError) as err:
        decode_group(_message(t)[0], max_seq_len=16)
    assert err.value.cause == "too_long" and err.value.meta is not None and err.value.meta.worker == "w7"
    problem = check_group(t, LIMITS)
    assert problem is not None and problem.cause == "too_long"


def test_metadata_claiming_more_tokens_than_max_seq_len_is_refused_before_allocating() -> None:
    table, _ = group_to_table(_tensors(n=8), run="r", prompt_id="p", worker="w7")
    md = dict(table.schema.metadata or {})
    md[b"jetrl.seqlen"] = b"500000000"  # padded arrays of 8 x 5e8 would be tens of GB: refused first
    data = encode_table(table.replace_schema_metadata(md))
    assert len(data) < 4000
    with pytest.raises(TrajectoryError) as err:
        decode_group(data, max_seq_len=16)
    assert err.value.cause == "length_mismatch" and "500000000" in str(err.value)


def test_metadata_shorter_than_the_rows_is_a_length_mismatch() -> None:
    table, _ = group_to_table(_tensors(), run="r", prompt_id="p", worker="w7")
    md = dict(table.schema.metadata or {})
    md[b"jetrl.seqlen"] = b"2"
    with pytest.raises(TrajectoryError) as err:
        decode_group(encode_table(table.replace_schema_metadata(md)))
    assert err.value.cause == "length_mismatch"


def test_list_offsets_past_the_values_are_a_length_mismatch() -> None:
    data = _message(_tensors())[0]
    offsets = np.array([0, 6, 12, 18], dtype=np.int32).tobytes()
    assert offsets in data
    # the first list column's offsets claim 900 tokens for the last row; its values hold 18
    lying = data.replace(offsets, np.array([0, 6, 12, 900], dtype=np.int32).tobytes(), 1)
    with pytest.raises(TrajectoryError) as err:
        decode_group(lying)
    assert err.value.cause == "length_mismatch"


def test_the_intake_terminates_with_the_cause_and_the_sender() -> None:
    intake = Intake(VersionWindow(100), limits=LIMITS)
    t = _tensors()
    t["input_ids"][0, 0] = 99
    v = intake.judge(*_message(t, "bad"), seq=1, version=0)
    assert (v.outcome, v.cause, v.prompt_id, v.worker) == ("malformed", "oov_token", "bad", "w7")
    assert intake.counts["malformed"] == 1 and intake.counts["terminated_oov_token"] == 1


def test_an_accepted_group_is_trained_only_when_committed() -> None:
    intake = Intake(VersionWindow(100), limits=LIMITS)
    assert intake.judge(*_message(_tensors(), "a"), seq=1, version=0).outcome == "accepted"
    assert "a" not in intake.trained and intake.state_dict() == {"trained": [], "counts": {}}
    assert intake.judge(*_message(_tensors(), "a"), seq=2, version=0).outcome == "duplicate", "a copy while pending"
    intake.commit(["a"])
    assert intake.trained == {"a"} and not intake.pending
    assert intake.state_dict() == {"trained": ["a"], "counts": {"accepted": 1, "duplicate": 1}}
    # judged after the commit, not saved until the next one: a resume reads it again and counts it once
    intake.judge(*_message(_tensors(), "b"), seq=3, version=0)
    resumed = Intake(VersionWindow(100), limits=LIMITS)
    resumed.load_state_dict(intake.state_dict())
    assert resumed.judge(*_message(_tensors(), "b"), seq=3, version=0).outcome == "accepted"
    assert resumed.counts["accepted"] == 2


def test_versions_the_trainer_never_made_are_an_error_naming_the_workflow_not_stale() -> None:
    tensors = _tensors()
    tensors["versions"] = np.where(tensors["loss_mask"] > 0, 7, -1).astype(np.int64)
    body, meta = encode_group_with_meta(tensors, run="r", prompt_id="p", worker="w7", workflow="my.pkg:Workflow")
    verdict = Intake(VersionWindow(1), limits=LIMITS).judge(body, trajectory_headers(meta), seq=1, version=2)
    assert verdict.outcome == "malformed" and verdict.cause == "impossible_versions" and verdict.worker == "w7"
    assert "my.pkg:Workflow" in verdict.error and "version 2" in verdict.error
    # the same group at a trainer that has made version 7 is fine
    assert Intake(VersionWindow(1), limits=LIMITS).judge(body, trajectory_headers(meta), seq=1, version=7).outcome == "accepted"
