"""The feeder reads a 🤗 `datasets` directory (save_to_disk) and a Parquet file: a real trainer issues
their rows, mapped to `prompt`/`answer`, onto the real PROMPTS work queue."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.subjects import Subjects
from services.common.bus import connect
from services.trainer.loop import Trainer
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from tests.support.trainer import take_prompts

RUN = "datasets"
ROWS = [{"uid": f"q{i}", "question": f"{i:03d}=", "target": f"{i:03d}"} for i in range(8)]


def _sources(tmp_path: Path) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(saved)
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    return {"saved": saved, "parquet": parquet}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["saved", "parquet"])
async def test_a_saved_dataset_and_a_parquet_file_feed_the_trainer(kind: str, nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    source = _sources(tmp_path)[kind]
    settings = TrainerSettings(
        run=f"{RUN}-{kind}", nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"), batch_groups=2,
        eta=100, checkpoint_every=0, fetch_timeout_s=0.2,
        feeder={"dataset_path": str(source), "shuffle": False, "max_in_flight": 4,
                "dataset": {"prompt_key": "question", "answer_key": "target", "id_key": "uid"}},
    )
    nc = await connect(nats_url, "test")
    trainer = Trainer(settings, TrainEngine(settings))
    try:
        await trainer.start(nc)
        assert await trainer.feeder.feed_once() == 4
        s = Subjects(settings.run)
        tasks = await take_prompts(nc.jetstream(), s.prompts_train, s.rollout_consumer, 4)
    finally:
        await trainer.close()
        await nc.close()
    assert [(t.data["prompt"], t.data["answer"], t.data["id"]) for t in tasks] == [
        (r["question"], r["target"], r["uid"]) for r in ROWS[:4]
    ]
