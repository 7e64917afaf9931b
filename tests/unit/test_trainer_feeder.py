"""The feeder: seeded epochs, the admission rule at every version, re-issue under new ids, state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.trainer.feeder import Feeder, load_rows

ROWS = [{"id": i, "prompt": f"{i:03d}=", "answer": f"{i:03d}"} for i in range(10)]


def _feeder(**kw: object) -> Feeder:
    args = {"run": "r", "rows": ROWS, "batch_groups": 2, "eta": 1, "max_in_flight": 100, "seed": 3}
    args.update(kw)
    return Feeder(**args)  # type: ignore[arg-type]


def _drain(f: Feeder, version: int) -> list[str]:
    out = []
    while (t := f.next_task(version)) is not None:
        out.append(t.prompt_id)
    return out


def test_admission_bound_holds_at_every_version() -> None:
    f = _feeder(epochs=0)
    for version in range(6):
        issued = _drain(f, version)
        c = f.counters
        assert c.issued - c.rejected == (f.eta + version + 1) * f.batch_groups  # filled up to, never past, the bound
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
