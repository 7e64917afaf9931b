"""Settings of `jetrl rollout` (`jetrl rollout --help` lists them with these docs)."""

from __future__ import annotations

import os
import socket
from typing import Any, ClassVar

from pydantic import Field, model_validator

from services.common.model_path import ModelPath
from services.common.settings import ServiceSettings
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.gconfig import GenerationHyperparameters


def _default_worker() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class RolloutSettings(ServiceSettings):
    service: ClassVar[str] = "rollout"

    model_path: ModelPath = ".jetrl/models/tiny"
    """Model whose tokenizer the workflow uses (the inference servers hold the weights): a directory, a
    name `jetrl models` lists, or a hub id in the local HF cache."""
    inference: InferenceClientSettings = InferenceClientSettings()
    """The inference servers and how to call them."""
    workflow: str = "services.rollout.workflows.rlvr:RLVRWorkflow"
    """The workflow, "package.module:Class" or "package.module.Class" (a RolloutWorkflow subclass, or an agent with `async def run`)."""
    workflow_kwargs: dict[str, Any] = {}
    """Keyword arguments of the workflow's constructor (override the standard ones below)."""
    eval_workflow: str = ""
    """The workflow evaluation prompts run (AReaL's `eval_workflow`, same spellings as `workflow`); empty: `workflow`."""
    eval_workflow_kwargs: dict[str, Any] = {}
    """Keyword arguments of `eval_workflow`'s constructor (the standard ones are offered as to `workflow`)."""
    should_accept_fn: str = ""
    """AReaL's `should_accept_fn`, "pkg.mod:fn" or "pkg.mod.fn": called with each group's tensor dict;
    a group it returns false for is rejected, counted (`groups_not_accepted_total`). Empty: keep all."""
    group_size: int = Field(8, ge=1)
    """Samples per prompt (GRPO's group). A workflow without a `group_size` argument is run this many times per prompt."""
    max_new_tokens: int = Field(32, ge=1)
    """Longest completion (per turn)."""
    temperature: float = 1.0
    """Sampling temperature."""
    reward_fn: str = "services.reward.builtin:copy3"
    """Reward function, "module:function", on the reward service's allow-list."""
    reward_timeout_s: float = 30.0
    """Longest wait for one reward request's reply."""
    reward_batch_max_items: int = Field(1024, ge=1)
    """The reward requests of episodes that ask in the same turn (the groups of one batched generation)
    go to the reward service as one request of at most this many items (services/rollout/reward_batching.py):
    one NATS round trip and one pool batch instead of one per group. 1: one request per call."""
    max_concurrent: int = Field(16, ge=1)
    """Episodes (prompts) this worker runs at once."""
    max_deliver: int = Field(3, ge=1)
    """Attempts per prompt; after the last failed one the prompt is published as rejected with the error."""
    ack_wait_s: float = Field(60.0, gt=0)
    """How long a prompt stays with a silent worker before redelivery (running episodes send in_progress)."""
    nak_delay_s: float = Field(2.0, ge=0)
    """Delay before a failed episode's prompt is delivered again."""
    publish_timeout_s: float = Field(10.0, gt=0)
    """Longest wait for the TRAJECTORIES stream to acknowledge a result."""
    drain_timeout_s: float = 10.0
    """On SIGTERM, how long in-flight episodes may finish before their prompts are handed back."""
    episode_timeout_s: float = Field(1800.0, ge=0)
    """Longest run of one episode; past it the attempt fails (retried after nak_delay_s, rejected at max_deliver). 0 = no limit."""
    fail_fast_after: int = Field(64, ge=0)
    """A worker none of whose episodes has succeeded stops after this many failed episode attempts,
    with the last one's exception (a workflow that fails every episode would burn the dataset in
    silence; `jetrl up` then stops with it on screen). Once one succeeded, failures are counted and
    logged but never stop the worker. 0: never stop."""
    worker: str = Field(default_factory=_default_worker)
    """This worker's name in trajectories and metrics (default hostname-pid)."""
    dump_to_file: bool = False
    """Write each trajectory as JSONL under {fileroot}/{experiment}/{trial}/{rollout|eval-rollout}/{version}/{task_id}.jsonl."""
    fileroot: str | None = None
    """Root directory of the trajectory dump (required with dump_to_file)."""
    dump_dir: str | None = None
    """Older name: dump_dir=X is dump_to_file=true fileroot=X."""
    experiment: str = ""
    """Experiment name in dump paths (default: the run name)."""
    trial: str = "trial0"
    """Trial name in dump paths."""
    metrics_interval_s: float = Field(5.0, gt=0)
    """Seconds between two metrics events on METRICS."""
    fetch_timeout_s: float = Field(1.0, gt=0)
    """How long one pull request for prompts waits at the server before it is asked again (and how
    soon pulling resumes after a lost connection); docs/rollout.md "What goes on the bus"."""
    version_poll_s: float = Field(0.5, gt=0)
    """While a prompt waits for the weights it may be generated with (its `min_version`), re-read the
    servers' versions this often (a load report on `weights.loaded` wakes it at once)."""
    servable_poll_s: float = Field(0.1, gt=0)
    """At start, until a server serves (a worker started beside loading servers), ask them this often: the
    first prompts wait on it (a poll of 0.5 s cost the first step ~0.25 s on average), and a loading
    local server answers at once."""

    @model_validator(mode="after")
    def _check(self) -> RolloutSettings:
        module, _, name = self.workflow.rpartition(":") if ":" in self.workflow else self.workflow.rpartition(".")
        if not module or not name:
            raise ValueError(f"workflow {self.workflow!r}: expected 'package.module:ClassName' or 'package.module.ClassName'")
        if self.dump_to_file and not self.fileroot:
            raise ValueError("dump_to_file=true needs fileroot (the dump's root directory)")
        if self.dump_dir and self.fileroot and self.dump_dir != self.fileroot:
            raise ValueError(f"dump_dir ({self.dump_dir!r}) and fileroot ({self.fileroot!r}) disagree; set only fileroot")
        return self

    @property
    def dump_root(self) -> str | None:
        """Where trajectories are dumped; None when they are not."""
        if self.dump_dir:
            return self.dump_dir
        return self.fileroot if self.dump_to_file else None

    @property
    def gconfig(self) -> GenerationHyperparameters:
        """The `gconfig` an AReaL workflow's constructor gets: one sample per request and per episode
        (`n_samples=1`); the worker runs the episode `group_size` times, as AReaL's `group_size` does."""
        return GenerationHyperparameters(n_samples=1, max_new_tokens=self.max_new_tokens, temperature=self.temperature)

    @property
    def experiment_name(self) -> str:
        return self.experiment or self.run
