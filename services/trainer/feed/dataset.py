"""Where the feeder's prompts come from: a JSONL or Parquet file, a 🤗 `datasets` directory written by
`save_to_disk`, or a dataset on the Hugging Face hub by name (with a config and a split). Each row is
then mapped to the feeder's fields (`prompt`, `answer`, `id`) by key mappings, or by a row-transform
function named in settings.

JSONL and Parquet are read here directly (no dependency, and an error names the bad line); saved
directories and hub names go through the `datasets` library (`pip install jetrl[data]`), which also
caches hub downloads the way researchers already know."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.common.refs import resolve_ref
from services.trainer.settings import DatasetOptions

Row = dict[str, Any]
__all__ = ["DatasetOptions", "Row", "load_rows"]


def load_rows(source: str | Path, options: DatasetOptions | None = None) -> list[Row]:
    """The dataset's rows, mapped to the feeder's fields; errors name the source and what is wrong."""
    options = options or DatasetOptions()
    path = Path(source)
    if path.is_file():
        raw = _read_parquet(path) if path.suffix == ".parquet" else _read_jsonl(path)
    elif path.is_dir():
        raw = _read_saved(path, options.split)
    elif _looks_local(str(source)):
        raise FileNotFoundError(f"dataset {source} does not exist")
    else:
        raw = _read_hub(str(source), options)
    if not raw:
        raise ValueError(f"dataset {source} has no rows")
    transform = _transform(options.transform)
    return [_map(transform(dict(row)) if transform else row, i, options, source) for i, row in enumerate(raw)]


def _looks_local(source: str) -> bool:
    """A path someone meant as a file (a hub name is `name` or `owner/name`, without a suffix)."""
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or Path(source).suffix in (".jsonl", ".json", ".parquet")


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected an object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[Row]:
    import pyarrow.parquet as pq

    return list(pq.read_table(path).to_pylist())


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise ImportError("saved dataset directories and hub datasets need the `datasets` library: pip install 'jetrl[data]'") from exc
    return datasets


def _read_saved(path: Path, split: str) -> list[Row]:
    datasets = _datasets()
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise ValueError(f"dataset directory {path} is not a `save_to_disk` dataset: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"dataset {path} has no split {split!r} (it has {sorted(loaded)})")
        loaded = loaded[split]
    return list(loaded.to_list())


def _read_hub(name: str, options: DatasetOptions) -> list[Row]:
    datasets = _datasets()
    try:
        return list(datasets.load_dataset(name, options.config, split=options.split).to_list())
    except Exception as exc:
        raise ValueError(f"dataset {name!r} (config {options.config!r}, split {options.split!r}) could not be loaded "
                         f"from the hub: {exc}") from exc


def _transform(ref: str) -> Callable[[Row], Row] | None:
    if not ref:
        return None
    fn = resolve_ref(ref)
    if not callable(fn):
        raise TypeError(f"dataset transform {ref!r} is not callable")
    return fn


def _map(row: Row, index: int, options: DatasetOptions, source: str | Path) -> Row:
    if not isinstance(row, dict):
        raise ValueError(f"dataset {source} row {index}: the transform returned {type(row).__name__}, not a dict")
    out = dict(row)
    if options.prompt_key in row:
        out["prompt"] = row[options.prompt_key]
    elif options.prompt_key != "prompt":  # a mapping that was asked for and finds nothing
        raise ValueError(f"dataset {source} row {index} has no {options.prompt_key!r} field (keys: {sorted(row)}); "
                         "fix prompt_key, or use a transform")
    # rows without a prompt (a workflow reading `messages`, say) are passed on as they are
    if options.answer_key in row:
        out["answer"] = row[options.answer_key]
    out["id"] = str(row.get(options.id_key, index))
    return out
