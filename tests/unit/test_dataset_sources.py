"""Prompt datasets: JSONL, Parquet and a `datasets` save_to_disk directory give the feeder the same
rows; key mappings and a row transform (a file reference) shape foreign rows; errors name the source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.refs import RefError, resolve_ref
from services.trainer.feed.dataset import DatasetOptions, load_rows

ROWS = [{"id": f"r{i}", "question": f"{i:03d}=", "solution": f"{i:03d}"} for i in range(5)]
MAPPED = DatasetOptions(prompt_key="question", answer_key="solution")


def expected() -> list[dict[str, str]]:
    return [{**r, "prompt": r["question"], "answer": r["solution"]} for r in ROWS]


def test_jsonl_parquet_and_a_saved_dataset_feed_the_same_rows(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])}).save_to_disk(saved)
    single = tmp_path / "single"
    datasets.Dataset.from_list(ROWS).save_to_disk(single)
    for source in (jsonl, parquet, saved, single):
        assert load_rows(source, MAPPED) == expected(), source
    assert len(load_rows(saved, DatasetOptions(prompt_key="question", split="test"))) == 2
    with pytest.raises(ValueError, match="no split 'dev'"):
        load_rows(saved, DatasetOptions(prompt_key="question", split="dev"))


def test_a_row_transform_from_a_file_and_missing_ids(tmp_path: Path) -> None:
    module = tmp_path / "shape.py"
    module.write_text("def to_prompt(row):\n    return {'prompt': row['q'] + '=', 'answer': row['q']}\n")
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "123"}\n{"q": "456"}\n')
    rows = load_rows(data, DatasetOptions(transform=f"{module}:to_prompt"))
    assert rows == [{"prompt": "123=", "answer": "123", "id": "0"}, {"prompt": "456=", "answer": "456", "id": "1"}]


def test_errors_name_the_source_and_the_fix(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        load_rows(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rows(tmp_path / "missing.jsonl")
    no_prompt = tmp_path / "np.jsonl"
    no_prompt.write_text('{"messages": [], "answer": "1"}\n')
    assert load_rows(no_prompt) == [{"messages": [], "answer": "1", "id": "0"}]  # a workflow reads its own fields
    with pytest.raises(ValueError, match=r"no .question. field .* fix prompt_key"):
        load_rows(no_prompt, DatasetOptions(prompt_key="question"))


def test_refs_accept_every_spelling_and_name_what_is_missing(tmp_path: Path) -> None:
    assert resolve_ref("json:dumps") is json.dumps
    assert resolve_ref("json.dumps") is json.dumps
    assert resolve_ref("os.path:join").__name__ == "join"
    f = tmp_path / "algo.py"
    f.write_text("class Thing:\n    class Inner:\n        x = 3\n")
    assert resolve_ref(f"{f}:Thing.Inner").x == 3
    with pytest.raises(RefError, match="cannot import module 'nope_mod'"):
        resolve_ref("nope_mod:X")
    with pytest.raises(RefError, match="has no attribute 'nothing'"):
        resolve_ref("json:nothing")
    with pytest.raises(RefError, match="no such file"):
        resolve_ref(f"{tmp_path}/none.py:X")
