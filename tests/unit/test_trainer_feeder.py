"""The feeder: seeded epochs, the admission rule at every version, re-issue under new ids with a cap
on genuine failures (stale groups uncharged), dropped rows counted by cause, each prompt's
`min_version`, filtered groups not re-issued, timeouts, unacknowledged publishes, state; and the
intake's verdicts as the feeder sees them (rejection markers, stale groups, foreign prompts)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from schemas.headers import rejection_headers, trajectory_headers
from schemas.messages import RejectionMarker, encode
from schemas.trajectory import encode_group_with_meta
from services.trainer.feed.dataset import load_rows
from services.trainer.feed.ledger import PromptLedger
from services.trainer.intake.intake import Intake
from services.trainer.versions import VersionWindow

ROWS = [{"id": i, "prompt": f"{i:03d}=", "answer": f"{i:03d}"} for i in range(10)]


def _feeder(**kw: object) -> PromptLedger:
    args = {"run": "r", "rows": ROWS, "batch_groups": 2, "max_in_flight": 100, "seed": 3}
    args.update(kw)
    args["window"] = VersionWindow(int(args.pop("eta", 1)))  # type: ignore[call-overload]
    return PromptLedger(**args)  # type: ignore[arg-type]


def _drain(f: PromptLedger, version: int) -> list[str]:
    """Issue what the admission rule allows, each publish acknowledged."""
    out = []
    while (t := f.next_task(version)) is not None:
        f.confirm(t.prompt_id)
        out.append(t.prompt_id)
    return out


def _group(prompt_id: str, rewards: list[float], *, version: int = 0) -> tuple[bytes, dict[str, str]]:
    """A trajectory message as a rollout worker publishes it."""
    n = len(rewards)
    ids = np.tile(np.arange(1, 7, dtype=np.int64), (n, 1))
    loss_mask = np.zeros_like(ids)
    loss_mask[:, 3:] = 1
    tensors = {"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": loss_mask,
               "logprobs": np.where(loss_mask > 0, -1.0, 0.0).astype(np.float32), "rewards": np.array(rewards, dtype=np.float32),
               "versions": np.where(loss_mask > 0, version, -1).astype(np.int64)}
    body, meta = encode_group_with_meta(tensors, run="r", prompt_id=prompt_id, worker="w")
    return body, trajectory_headers(meta)


def _marker(prompt_id: str) -> tuple[bytes, dict[str, str]]:
    """The rejection marker a worker publishes for a prompt it gives up on (failed episodes, a poison prompt)."""
    body = encode(RejectionMarker(run="r", prompt_id=prompt_id, worker="w", reason="terminated: does not decode"))
    return body, rejection_headers("r", prompt_id)


def test_admission_bound_holds_at_every_version() -> None:
    f = _feeder(epochs=0)
    for version in range(6):
        issued = _drain(f, version)
        c = f.counters
        assert c.issued - c.rejected == (f.window.eta + version + 1) * f.batch_groups  # filled up to, never past, the bound
        assert issued, "each new version admits more prompts"
        for pid in issued[:1]:
            f.on_rejected(pid)  # a rejection frees one slot: re-issued under a new id
        retry = _drain(f, version)
        assert len(retry) == 1 and retry[0] == issued[0] + "-r1"
        for pid in list(f.in_flight):
            f.on_accepted(pid)


def test_in_flight_cap() -> None:
    f = _feeder(max_in_flight=3)
    assert len(_drain(f, 10)) == 3
    f.on_accepted(next(iter(f.in_flight)))
    assert len(_drain(f, 10)) == 1
    assert f.on_accepted("never-issued") is False and f.counters.accepted == 1


def test_epochs_are_seeded_permutations_and_end() -> None:
    f = _feeder(epochs=2, max_in_flight=100, eta=100)
    ids = _drain(f, 0)
    assert len(ids) == 20 and f.dataset_done
    first = [int(p.split("-")[1]) for p in ids[:10]]
    second = [int(p.split("-")[1]) for p in ids[10:]]
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10)) and first != second
    assert first == [int(p.split("-")[1]) for p in _drain(_feeder(epochs=1, eta=100), 0)]  # same seed, same order
    assert not f.exhausted
    for pid in list(f.in_flight):
        f.on_accepted(pid)
    assert f.exhausted


def test_state_round_trip_continues_identically() -> None:
    a = _feeder()
    first = _drain(a, 0)
    a.on_rejected(first[1])
    a.on_accepted(first[0])
    b = _feeder()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert _drain(a, 3) == _drain(b, 3)
    assert a.counters == b.counters


def test_load_rows_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1="}\n{oops\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2"):
        load_rows(path)
    with pytest.raises(FileNotFoundError):
        load_rows(tmp_path / "missing.jsonl")


def test_a_row_is_dropped_after_max_attempts() -> None:
    f = _feeder(max_attempts=3, epochs=1, eta=100)
    first = _drain(f, 0)[0]
    for attempt in range(3):
        pid = first + (f"-r{attempt}" if attempt else "")
        assert pid in f.in_flight
        assert f.on_rejected(pid)
        _drain(f, 0)  # the re-issue goes out first, before new rows
    assert f.counters.dropped == 1 and f.counters.rejected == 3 and f.counters.reissued == 2
    assert first + "-r3" not in f.in_flight and not f.reissue
    for pid in list(f.in_flight):
        f.on_accepted(pid)
    assert f.exhausted  # a dropped row does not hold the end of training


def test_rejection_marker_from_the_worker_reissues_then_drops_the_row() -> None:
    f = _feeder(max_attempts=2, eta=100)
    intake = Intake(f.window, feeder=f)
    pid = _drain(f, 0)[0]
    assert intake.judge(*_marker(pid), seq=1, version=0).outcome == "rejected"
    assert list(f.reissue) == [[0, int(pid.split("-")[1]), 1, 1]] and f.counters.rejected == 1
    retry = f.next_task(0)
    assert retry is not None and retry.prompt_id == pid + "-r1"
    assert intake.judge(*_marker(retry.prompt_id), seq=2, version=0).outcome == "rejected"
    assert not f.reissue and f.counters.dropped == 1 and retry.prompt_id not in f.in_flight


def test_filtered_groups_free_their_slot_and_are_not_reissued() -> None:
    """Prompts the model always solves (dynamic filtering drops every group) must not pile up as
    re-issues and stall the feeder: each frees its slot for the next new row."""
    f = _feeder(max_in_flight=2, eta=100, epochs=0)
    intake = Intake(f.window, dynamic_filtering=True, feeder=f)
    seen: set[str] = set()
    for seq in range(20):
        issued = _drain(f, 0)
        assert issued, "the feeder stalled"
        seen.update(issued)
        verdict = intake.judge(*_group(issued[0], [1.0, 1.0, 1.0]), seq=seq, version=0)
        assert verdict.outcome == "filtered"
        for pid in issued[1:]:
            f.on_accepted(pid)
    assert not f.reissue and not any("-r" in pid for pid in seen)
    assert f.counters.filtered == 20 and f.counters.rejected == 20 and f.counters.dropped == 0
    assert intake.judge(*_group(_drain(f, 0)[0], [1.0, 0.0]), seq=99, version=0).outcome == "accepted"


def test_an_unanswered_prompt_times_out_and_is_reissued() -> None:
    f = _feeder(in_flight_timeout_s=60.0, eta=100, max_in_flight=3)
    issued = _drain(f, 0)
    assert f.expire(time.monotonic() + 30) == []
    assert sorted(f.expire(time.monotonic() + 61)) == sorted(issued)
    assert f.counters.timed_out == 3 and f.counters.in_flight == 0
    assert _drain(f, 0) == [pid + "-r1" for pid in issued]
    # a resume restarts the clocks: the downtime does not count against the prompts in flight
    g = _feeder(in_flight_timeout_s=60.0, eta=100, max_in_flight=3)
    g.load_state_dict(json.loads(json.dumps(f.state_dict())))
    assert g.expire(time.monotonic() + 30) == [] and len(g.expire(time.monotonic() + 61)) == 3


def test_a_failed_publish_puts_the_row_back_and_an_unacknowledged_one_is_not_saved_as_issued() -> None:
    f = _feeder(eta=100, max_in_flight=5)
    done = _drain(f, 0)[:2]
    for pid in done:
        f.on_rejected(pid)
    before = json.loads(json.dumps(f.state_dict()))
    task = f.next_task(0)
    assert task is not None and task.prompt_id == done[0] + "-r1"
    # a checkpoint while the publish is in flight saves the state as if it had not been issued
    assert f.state_dict() == before
    f.put_back(task.prompt_id)  # the publish failed for good
    assert f.state_dict() == before and f.counters.in_flight == 3
    again = f.next_task(0)
    assert again is not None and again.prompt_id == task.prompt_id


def test_a_tag_sets_this_incarnations_prompts_apart() -> None:
    f = _feeder(eta=100, tag="ab12cd")
    intake = Intake(f.window, feeder=f)
    ours = _drain(f, 0)
    assert all(pid.endswith(".ab12cd") for pid in ours)
    # the same row's answer to the earlier incarnation's prompt: not ours, not trained, no slot freed
    old_id = ours[0].removesuffix(".ab12cd")
    assert intake.judge(*_group(old_id, [1.0, 0.0], version=40), seq=1, version=0).outcome == "foreign"
    assert intake.judge(*_marker(old_id), seq=2, version=0).outcome == "foreign"
    assert f.counters.in_flight == len(ours) and old_id not in intake.trained
    assert intake.judge(*_group(ours[0], [1.0, 0.0]), seq=3, version=0).outcome == "accepted"
    g = _feeder(eta=100)
    g.load_state_dict(json.loads(json.dumps(f.state_dict())))
    assert g.tag == "ab12cd"


def test_stale_groups_are_reissued_uncharged_and_never_drop_the_row() -> None:
    """Old weights are not the row's fault: however often a row's group comes back stale (servers
    stuck on old weights after a bus outage), it is re-issued, and only genuine failures count."""
    f = _feeder(max_attempts=2, eta=0, max_in_flight=1)
    intake = Intake(f.window, feeder=f)
    pid = _drain(f, 0)[0]
    for k in range(1, 11):  # generated with v0, judged at v3: stale every time
        assert intake.judge(*_group(pid, [1.0, 0.0], version=0), seq=k, version=3).outcome == "stale"
        (pid,) = _drain(f, 3)
        assert pid.endswith(f"-r{k}")
    c = f.counters
    assert c.stale == 10 and c.reissued == 10 and c.dropped == 0 and c.in_flight == 1
    # the row's genuine failures still count, across its stale re-issues: the second one drops it
    assert intake.judge(*_marker(pid), seq=20, version=3).outcome == "rejected"
    (pid,) = _drain(f, 3)
    assert intake.judge(*_group(pid, [1.0, 0.0], version=0), seq=21, version=3).outcome == "stale"
    (pid,) = _drain(f, 3)
    assert intake.judge(*_marker(pid), seq=22, version=3).outcome == "rejected"
    assert c.dropped == 1 and c.dropped_by_cause == {"rejected": 1} and pid not in f.in_flight
    values = f.metric_values()
    assert values["feeder_stale"] == 11 and values["feeder_dropped_rejected"] == 1 and values["feeder_dropped"] == 1


def test_dropped_rows_are_counted_by_cause() -> None:
    f = _feeder(max_attempts=1, eta=100, max_in_flight=4, in_flight_timeout_s=60.0)
    intake = Intake(f.window, feeder=f)
    a, b, c, d = _drain(f, 0)
    assert f.on_rejected(a, "dead_letter")
    bad_headers = {**rejection_headers("r", b)}
    assert intake.judge(b"not a marker", bad_headers, seq=1, version=0).outcome == "malformed"
    assert intake.judge(*_marker(c), seq=2, version=0).outcome == "rejected"
    assert f.expire(time.monotonic() + 61) == [d]
    n = f.counters
    assert n.dropped_by_cause == {"dead_letter": 1, "malformed": 1, "rejected": 1, "timed_out": 1}
    assert n.dropped == 4 and not f.reissue and n.in_flight == 0
    # a cause the feeder does not know yet is counted under its own name, never refused
    e = _drain(f, 0)[0]
    assert f.on_rejected(e, "invalid_group") and n.dropped_by_cause["invalid_group"] == 1
    values = f.metric_values()
    assert values["feeder_dropped_invalid_group"] == 1 and values["feeder_dropped_timed_out"] == 1
    g = _feeder()
    g.load_state_dict(json.loads(json.dumps(f.state_dict())))
    assert g.counters == f.counters


def test_min_version_is_the_oldest_version_the_trainer_will_accept() -> None:
    """At eta=0 every prompt issued at version v must be generated with v: the prompts issued right
    after a step must not start on the weights that step replaced."""
    f = _feeder(eta=0, epochs=0)
    intake = Intake(f.window, feeder=f)
    for version in range(4):
        tasks = list(iter(lambda v=version: f.next_task(v), None))  # type: ignore[misc]
        assert len(tasks) == 2 and {t.min_version for t in tasks} == {version}
        for t in tasks:
            f.confirm(t.prompt_id)
        if version:  # one group comes back stale (at version 0 none can be): its re-issue waits for this version too
            assert intake.judge(*_group(tasks[0].prompt_id, [1.0, 0.0], version=version - 1), seq=1, version=version).outcome == "stale"
            retry = f.next_task(version)
            assert retry is not None and retry.min_version == version
        for pid in list(f.in_flight):
            f.on_accepted(pid)
    # eta=2: the prompts for the steps ahead may use weights up to eta versions older than their step's
    g = _feeder(eta=2, epochs=0, eval_rows=ROWS[:3])
    mins = [t.min_version for t in iter(lambda: g.next_task(0), None)]
    assert mins == [0, 0, 0, 0, 0, 0]  # expected steps 0..2, less eta
    for pid in list(g.in_flight)[:4]:
        g.on_accepted(pid)
    assert [t.min_version for t in iter(lambda: g.next_task(2), None)] == [1, 1, 2, 2]
    # an eval round measures the weights of its step: generated with them, never older
    assert [t.min_version for t in g.eval_tasks(7, 3, 7, "n")] == [7, 7, 7]


def test_a_checkpoint_saved_before_uncharged_reissues_loads() -> None:
    f = _feeder()
    f.load_state_dict({"counters": {"issued": 2, "rejected": 1}, "epoch": 0, "index": 2,
                       "in_flight": {"0-4-r1": [0, 4, 1]}, "reissue": [[0, 7, 2]], "tag": ""})
    task = f.next_task(0)
    assert task is not None and task.prompt_id == "0-7-r2"
    assert f.in_flight["0-4-r1"] == [0, 4, 1, 1] and f.counters.stale == 0


def test_no_version_gating_when_the_trainer_publishes_no_weights() -> None:
    """No server will ever load a newer version: a prompt that waited for one would wait forever."""
    f = _feeder(eta=0, epochs=0, eval_rows=ROWS[:2], gate_versions=False)
    for pid in _drain(f, 0):
        f.on_accepted(pid)
    assert [t.min_version for t in iter(lambda: f.next_task(1), None)] == [0, 0]
    assert [t.min_version for t in f.eval_tasks(1, 2, 1, "n")] == [0, 0]
