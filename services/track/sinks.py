"""The trackers a run's figures go to. Each sink takes (tag -> value, step) rows; `Guarded` wraps one
so that a failing backend is logged and counted, and switched off after `max_failures` failures in a
row, while the other sinks go on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from services.common.logging import get_logger

log = get_logger("track")


class Sink(Protocol):
    name: str

    def log_config(self, config: dict[str, Any]) -> None: ...
    def write(self, values: dict[str, float], step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class TensorBoardSink:
    """Event files through torch's `SummaryWriter` (read back by TensorBoard's EventAccumulator)."""

    name = "tensorboard"

    def __init__(self, log_dir: str, flush_s: float) -> None:
        from torch.utils.tensorboard import SummaryWriter

        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=log_dir, flush_secs=max(1, int(flush_s)))

    def log_config(self, config: dict[str, Any]) -> None:
        import json

        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, sort_keys=True, default=str) + "\n```", 0)

    def write(self, values: dict[str, float], step: int) -> None:
        wall = time.time()
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=wall)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run; every row carries `trainer_step`, the x-axis of every chart (W&B's own `_step`
    counts rows, and rollout figures arrive between trainer steps)."""

    name = "wandb"

    def __init__(self, mode: str, project: str, entity: str, directory: str, name: str) -> None:
        import wandb

        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(mode=mode, project=project, entity=entity or None, dir=directory or None, name=name,  # type: ignore[arg-type]
                              settings=wandb.Settings(console="off", silent=True))
        self.run.define_metric("trainer_step")
        self.run.define_metric("*", step_metric="trainer_step")

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def write(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, "trainer_step": step})

    def flush(self) -> None:
        pass  # wandb-core writes as it goes

    def close(self) -> None:
        self.run.finish()


class Guarded:
    """A sink whose failures are counted, never raised."""

    def __init__(self, sink: Sink, max_failures: int) -> None:
        self.sink = sink
        self.name = sink.name
        self.max_failures = max_failures
        self.failures = 0
        self.in_a_row = 0
        self.rows = 0
        self.off = False

    def call(self, what: str, *args: Any) -> None:
        if self.off:
            return
        try:
            getattr(self.sink, what)(*args)
        except Exception as exc:  # a tracker's failure never reaches the run
            self.failures += 1
            self.in_a_row += 1
            log.warning("tracker failed", sink=self.name, call=what, error=repr(exc), failures=self.failures)
            if self.in_a_row >= self.max_failures:
                self.off = True
                log.error("tracker switched off after repeated failures", sink=self.name, failures=self.failures)
            return
        self.in_a_row = 0
        if what == "write":
            self.rows += 1
