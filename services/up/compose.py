"""What `jetrl up` starts, as a typed plan (plan.py): every service's settings, from `up`'s own, the
preset, the run's credentials and the user's sections (theirs win), and the order and readiness of
each process."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.ports import free_port
from services.common.settings import deep_merge
from services.up import SERVICE_SECTIONS, device
from services.up.credentials import RunCredentials
from services.up.layout import Layout
from services.up.plan import HttpReady, Step
from services.up.presets import preset_for
from services.up.presets import section as preset_section
from services.up.settings import UpSettings
from services.up.stack import settings_class, to_env
from services.up.trust import announce_trust
from services.up.weights import in_memory, trainer_weights


@dataclass(frozen=True)
class Composed:
    plan: list[Step]
    """The processes, in start order."""
    learning: dict[str, dict[str, Any]]
    """The merged sections of the services that decide what is learned (trainer, rollout, inference), for the printout."""
    servers: list[str]
    """The inference servers' URLs (their ports picked before anything starts)."""
    broadcast: bool
    """Whether weights travel in memory to the servers (it decides the processes' priorities)."""


def compose(s: UpSettings, sections: dict[str, dict[str, Any]], creds: RunCredentials, run_dir: Path, url: str, shape: Layout,
            dataset: str, eval_set: Path | None, monitor_url: str | None = None, environ: Mapping[str, str] = os.environ) -> Composed:
    """The stack plan of a run on the bus at `url`. `eval_set`: the demo's or a generated task's held-out
    prompts; `monitor_url`: the embedded server's monitoring port (a timed-out write asks whether the store is full);
    `environ`: `jetrl up`'s own environment (the CUDA variables the computing services get with `device: cuda`)."""
    threads = {"OMP_NUM_THREADS": str(shape.torch_threads)}  # the trainer's and the servers' tensor work
    common = {"run": s.run, "nats_url": url, "nats_replicas": s.nats_replicas, "log_format": "json",
              **({"nats_monitor_url": monitor_url} if monitor_url is not None else {})}
    preset = preset_for(s.dataset_path)  # the copy3 demo's settings, for the demo only (presets.py)
    # the run's credentials under the preset under the user's own section (theirs win)
    sec: Callable[[str], dict[str, Any]] = lambda name: deep_merge(  # noqa: E731
        creds.section(name, sections.get(name, {})), preset_section(preset, sections, name))
    # Ports first, so that every service is told where the servers will be before any of them is up.
    servers = [f"http://127.0.0.1:{free_port()}" for _ in range(s.inference_servers)]
    signed = announce_trust(run_dir, sections)  # the trainer signs announcements, the agents check them
    trainer: dict[str, Any] = {
        **common,
        **device.trainer_section(s),  # up.device / up.dtype (device.py), under the trainer's own section
        **signed,
        "model_path": s.model_path,
        "output_dir": str(run_dir / "trainer"),
        "total_steps": s.total_steps,
        "feeder": {"dataset_path": dataset},
    }
    # Weights travel in memory to the servers it started, unless simulated (weights.py, docs/weights.md)
    served = deep_merge(device.inference_section(s), sec("inference"))  # up.device's, under the inference section
    tsec = device.with_weights_dtype(trainer_weights(sec("trainer"), servers, _simulated(served)), served["dtype"])
    if not s.dataset_path and eval_set is not None:  # the demo: a fixed eval set of 32 prompts, every 10 steps
        trainer["feeder"] |= {"eval_dataset_path": str(eval_set), "eval_every": 10, "eval_size": 32}
    elif eval_set is not None:  # a generated task's held-out rows, for a trainer section's `feeder.eval_every`
        trainer["feeder"]["eval_dataset_path"] = str(eval_set)
    trainer = deep_merge(trainer, tsec)
    # The trainer first: its start (DeepSpeed's import and init, the model) is the longest of all and
    # needs no inference server, so it overlaps the servers' start instead of following it. Its
    # prompts wait in the PROMPTS stream until a rollout worker is up.
    plan = [Step("trainer", "services.trainer", to_env("trainer", trainer) | threads | device.trainer_env(s, environ)),
            Step("reward", "services.reward", to_env("reward", deep_merge(common, sec("reward"))))]
    from services.up.grammar import skip_tokenizer_init  # the rollout's workflow module (numpy): once settings are read

    skip_tokenizer = skip_tokenizer_init(sec("rollout"))
    for i, server in enumerate(servers):
        port = int(server.rsplit(":", 1)[1])
        # skip_tokenizer_init: ids only (the rollout client decodes and applies stop strings itself),
        # unless the workflow may send grammars, which need the tokenizer (grammar.py)
        inference = {**common, "model_path": s.model_path, "port": port, "seed": i, "torch_threads": shape.torch_threads,
                     "skip_tokenizer_init": skip_tokenizer}
        # ready: a server that dies or never loads is reported, with its log, before the live display
        plan.append(Step(f"inference-{i}", "services.inference",
                         to_env("inference", deep_merge(inference, served)) | threads | device.serving_env(s, environ),
                         ready=HttpReady(server)))
        weights = {**common, **signed, "server": server, "cache_dir": str(run_dir / f"weights-cache-{i}")}
        plan.append(Step(f"weights-{i}", "services.weights", to_env("weights", deep_merge(weights, sec("weights")))))
    # The rollout workers start beside the servers too: their start (imports, the tokenizer) overlaps
    # the servers' model load, and each takes no prompt before a server serves (version_gate.py).
    for i in range(shape.rollout_workers):
        rollout = {**common, "model_path": s.model_path, "worker": f"rollout-{i}", "inference": {"servers": servers}}
        # replicas: one dying is survivable (its prompts are redelivered); all of them is not
        plan.append(Step(f"rollout-{i}", "services.rollout", to_env("rollout", deep_merge(rollout, sec("rollout"))), required=False))
    if "track" in sections:  # experiment trackers: a follower of the METRICS stream; losing it loses no training
        config = run_dir / "config.json"
        config.write_text(json.dumps({"up": s.model_dump(), **{n: sec(n) for n in SERVICE_SECTIONS if n != "track"}}, default=str))
        track = {**common, "config_path": str(config)}
        plan.append(Step("track", "services.track", to_env("track", deep_merge(track, sec("track"))), required=False))
    learning = {"trainer": trainer, "rollout": sec("rollout"), "inference": served}
    return Composed(plan, learning, servers, in_memory(tsec))


def _simulated(inference: dict[str, Any]) -> bool:
    """Whether the inference section asks for simulated servers (read as the server reads it)."""
    return bool(getattr(settings_class("inference").model_validate(inference), "simulate", False))
