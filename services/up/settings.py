"""Settings of `jetrl up`: the local stack. Each service's own settings come from the same YAML file
(`--config`), one section per service (`inference:`, `rollout:`, `reward:`, `trainer:`, `weights:`),
and reach the service processes as environment variables only."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from services.common.model_path import ModelPath
from services.common.settings import ServiceSettings, flag

BesideTrainer = Literal["reward", "weights", "rollout", "track"]
"""A service that may run on the trainer's cores (`UpSettings.beside_trainer`); never an inference server."""


class UpSettings(ServiceSettings):
    service: ClassVar[str] = "up"

    run: str = "demo"
    """Run name (part of every subject); the run directory is `<run_dir>/<run>`."""
    run_dir: str = "runs"
    """Where each run keeps its NATS store, logs, checkpoints, metrics and plots."""
    model_path: ModelPath = ".jetrl/models/tiny"
    """Model served and trained: a model directory (used as it is, never written), a name `jetrl models`
    lists (`jetrl make-model NAME` first), or a hub id in the local HF cache; the default tiny model is built
    here if the path does not exist."""
    dataset_path: str = ""
    """Prompt dataset (JSONL/Parquet); empty = generate the copy3 demo prompts in the run directory."""
    dataset_size: int = Field(4096, ge=1)
    """Number of demo prompts generated when dataset_path is empty."""
    rollout_workers: int = Field(1, ge=1, json_schema_extra=flag("--rollout-workers"))
    """Rollout worker processes. One runs the demo's `max_concurrent` 64 episodes on 2 cores with ~25%
    less CPU per sample than two (docs/up.md "Processes and threads"); add workers when one process's
    core is what generation waits for (many cores, many servers)."""
    torch_threads: int | None = Field(None, ge=1)
    """torch intra-op threads (OMP_NUM_THREADS) of the trainer and of each inference server (an
    `inference: {torch_threads}` section overrides the servers'). Unset: the cores shared equally
    among the trainer and the servers, at least 1. Every other process runs one thread."""
    pin_trainer: bool = True
    """Give the trainer cores of its own: it runs on the first `torch_threads` cores this process may
    use and every other service (servers, rollout workers, reward, weights agents) on the rest, but those
    `beside_trainer` names, where `torch_threads` leaves cores to the rest (on 2 cores: the trainer, the
    reward service and the weights agent on one, the server and the rollout worker on the other; with
    `torch_threads` 2 there, as the real-model example sets, nothing is pinned). Off: every process may
    run on every core. On 2 cores the first step came ~1-3 s sooner pinned (docs/up.md
    "Processes and threads")."""
    beside_trainer: list[BesideTrainer] | None = None
    """With the trainer pinned: the services that run on the trainer's cores instead of the others'
    (each of their processes: the reward service's pool too). The inference servers never do: they and
    the trainer do the tensor work. Empty: the trainer's cores are its own. Unset: the reward service
    and the weights agents where the trainer runs one torch thread (a single thread only loses the CPU
    time they take; a team of OpenMP threads stalls at every barrier when one of them is preempted),
    else none. On 2 cores the first step came ~1.3 s sooner with them beside the trainer (their
    start-up no longer delays the inference server's), seconds a step about the same (docs/up.md)."""
    fork_server: bool = True
    """Start the services by forking them from one process that imported what they import (pydantic,
    nats-py, aiohttp; torch and transformers' model classes) once, instead of `python -m` each from
    nothing (services/up/fork/server.py). A service whose environment differs from the others' in more
    than its settings is started with `python -m` all the same; with `device: cuda` every one is. On 2
    cores the first step came ~2-3 s sooner (docs/up.md "Start-up"). Off: `python -m` each."""
    serving_nice: int = Field(0, ge=0, le=19)
    """Niceness (`os.nice`) of the inference servers, rollout workers and reward service, against the
    trainer's 0: above 0, on shared cores the trainer's step (on the path of every version) runs
    first and generation goes on in what is left. 0 (the default): all equal; on 2 shared cores a
    nice of 5 made neither the first step nor the time to 0.9 measurably sooner (docs/up.md)."""
    background_nice: int = Field(10, ge=0, le=19)
    """Niceness of the processes no trainer step waits for: the weights agents when the weights
    travel by broadcast (the trainer sends them to the servers itself; the agents only catch up a
    server that joins late; on the disk path they get `serving_nice`) and the experiment tracker."""
    inference_servers: int = Field(1, ge=1)
    """Inference servers (each with its own weights agent), on the CPU or, with `device: cuda`, on the GPU."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the trainer and the inference servers compute. cpu: on this machine's cores (the trainer
    sees no GPU even where one is). cuda: both on the first visible GPU (`CUDA_VISIBLE_DEVICES` picks
    another), sharing it: the one-GPU colocated mode, the weights handed over by CUDA IPC handle, the
    memory split by `serving_memory_fraction`. Refused before anything starts when torch sees no CUDA
    GPU. A `trainer:` / `inference:` section's own `dtype`, `device`, `memory_fraction` win (docs/gpu.md)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The precision the trainer trains in (DeepSpeed's bf16 mode: fp32 master weights), the versions
    travel in and the servers serve in. auto: bfloat16 with `device: cuda`, float32 on the CPU (the tiny
    model's work is too small to gain). A real model on a CPU with AVX512-BF16 or AMX trains and serves
    faster in bfloat16 (examples/smollm2_arith.yaml sets it: docs/trainer.md "Choosing settings")."""
    serving_memory_fraction: float = Field(0.3, gt=0, lt=1)
    """`device: cuda`: the share of the GPU's memory the inference servers may take together (each an
    equal part, its `memory_fraction`: model and KV cache); the trainer takes the rest."""
    total_steps: int = Field(500, ge=1, json_schema_extra=flag("--steps"))
    """Trainer steps at most; the run ends when the trainer finishes them (or at `stop_at_reward`). The
    demo reaches its 0.9 in ~150-250 steps (32 prompts a step): 500 leaves room for a slow seed."""
    stop_at_reward: float | None = Field(None, ge=0)
    """Stop early once the 10-step mean reward reaches this (0 = run all `total_steps`). Unset: 0.9 for
    the demo (no `dataset_path`: copy3 is learned there, and the run ends instead of idling on), 0 with
    a dataset of your own."""
    stop_at_eval_lift: float | None = Field(None, gt=0, le=1)
    """Stop early at the first eval round whose pass rate (the share of eval samples with reward 1) is
    this much over the run's first round, e.g. 0.15 for +15 points; the round's step counts, whenever
    its answers come in. Needs a round at step 0 (`trainer.feeder.eval_at_start`) and an eval set.
    Unset: no such stop."""
    pass_env: list[str] = []
    """Environment variables of `jetrl up`'s own environment passed through to every service, beside the
    few it always passes (PATH, HOME, ...), e.g. `[OPENAI_API_KEY, HF_HOME]` for an agent that reads
    them; names not set are skipped. Nothing else of the caller's environment reaches a service. `PYTHONPATH`
    listed here is appended to jetrl's own (so a workflow's package outside the repository imports)."""
    display: str = "auto"
    """auto (live table on a terminal, a line per step otherwise) | live | lines | none."""
    stop_timeout_s: float = Field(20.0, gt=0)
    """On exit, how long services get to drain after SIGTERM before they are killed."""
    ready_timeout_s: float = Field(180.0, gt=0)
    """How long the inference servers may take to become healthy."""
    bus: Literal["embedded", "external"] = "embedded"
    """embedded: a nats-server of its own in the run directory; external: the NATS at `nats_url` (a
    server or a cluster you run, e.g. `jetrl nats --cluster 3`; with `nats_replicas` for its streams)."""
    recording_max_bytes: int = Field(-1, ge=-1)
    """Size cap of the recording (the TRAJECTORIES stream) on the embedded bus, bytes (-1: none: a
    long run fills the disk eventually). At the cap, `recording_discard` decides."""
    recording_discard: Literal["old", "new"] = "old"
    """At `recording_max_bytes`: old: the oldest recorded groups are dropped; new: new groups are
    refused (the rollout workers log an error naming TRAJECTORIES) and training waits until space is
    made (`jetrl bus init` with a higher `trajectories_max_bytes`, or a purge)."""
    store_restart_free_bytes: int = Field(64_000_000, ge=0)
    """With `bus: embedded`: once a stream could not be written for want of space (an error naming it
    is logged and shown), nats-server is restarted when its store's filesystem has this much free
    again (it keeps failing the stream until it restarts); the services reconnect by themselves."""
    open_bus: bool = False
    """With `bus: embedded`, let the nats-server admit anyone without credentials (logged as a
    warning): any process on this host can then read the prompts, publish groups that are trained and
    announce weights. Default false: the run's bus admits only its own users, one per service, each
    allowed only its subjects, with passwords made per run in `<run_dir>/<run>/secrets/`
    (docs/security.md)."""
