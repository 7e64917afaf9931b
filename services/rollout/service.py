"""`jetrl rollout`'s lifetime: connect, build the workflow, run the worker loop and the metrics loop
under the supervisor until SIGTERM, then drain.

Standard workflow arguments: a workflow class's constructor gets, for each of these names it
accepts and `workflow_kwargs` does not set, the worker's value: `tokenizer` (loaded from
`model_path`), `reward` (a RewardClient on this worker's NATS connection), `reward_fn`,
`reward_timeout_s`, `group_size`, `max_new_tokens`, `temperature`, `gconfig` (AReaL's
`GenerationHyperparameters`, `n_samples=1`; `workflow_kwargs.gconfig.<field>=...` changes it).
`reward_fn` and `reward_timeout_s` are offered to a workflow of the user's only when the rollout
settings set them (their defaults are the copy3 demo's, meaningless to another workflow: a missing
`reward_fn` is then the constructor's clear error, never a silently substituted one). An agent named
directly as the workflow gets `tokenizer`, `max_new_tokens` and `temperature`, so the generation
settings apply to it. Callables in `workflow_kwargs` may be reference strings (`kwargs.py`). A
workflow whose constructor does not name `group_size` (a `**kwargs` catch-all does not count) is
wrapped in `GroupedRolloutWorkflow(group_size)`. The weight versions of every group are checked
(`versions.CheckedWorkflow`).
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from schemas.sglang_protocol import READY_POLL_TIMEOUT_S, readiness_urls
from services.common.bus import Bus, close_connection
from services.common.health import http_check, nats_responder_check, register_check
from services.common.logging import bind_context, get_logger
from services.common.metrics import MetricsPublisher
from services.common.runner import Supervisor, supervise
from services.rollout.dump import TrajectoryDumper
from services.rollout.kwargs import resolve_callable_kwargs
from services.rollout.resolve import is_agent, resolve_workflow
from services.rollout.selection import Accepting, EvalOrTrain
from services.rollout.settings import RolloutSettings
from services.rollout.tokenizer import load_pretrained_tokenizer
from services.rollout.versions import CheckedWorkflow
from services.rollout.worker import RolloutWorker
from services.rollout.worker_config import WorkerConfig
from services.rollout.workflow import GroupedRolloutWorkflow, RolloutWorkflow, WorkflowError, import_ref

log = get_logger("rollout")


def standard_kwargs(settings: RolloutSettings, tokenizer: Callable[[], Any], reward: Any) -> dict[str, Callable[[], Any]]:
    """Name -> how to make it; made only when the workflow asks for it (no tokenizer load otherwise)."""
    return {
        "tokenizer": tokenizer,
        "reward": lambda: reward,
        "reward_fn": lambda: settings.reward_fn,
        "reward_timeout_s": lambda: settings.reward_timeout_s,
        "group_size": lambda: settings.group_size,
        "max_new_tokens": lambda: settings.max_new_tokens,
        "temperature": lambda: settings.temperature,
        "gconfig": lambda: settings.gconfig,
    }


#: standard values whose defaults belong to jetrl's own demo: offered to a user's workflow only when set
_DEMO_STANDARD = ("reward_fn", "reward_timeout_s")
#: standard values an agent named directly as the workflow gets (the agent workflow's own settings)
_AGENT_STANDARD = ("tokenizer", "max_new_tokens", "temperature")


def build_workflow(settings: RolloutSettings, standard: dict[str, Callable[[], Any]]) -> RolloutWorkflow:
    """The workflow `jetrl rollout` runs: `workflow` (and `eval_workflow` for evaluation prompts),
    grouped, version-checked, filtered by `should_accept_fn`."""
    workflow = _build_one(settings, standard)
    if settings.eval_workflow:
        evaluating = settings.model_copy(update={"workflow": settings.eval_workflow, "workflow_kwargs": settings.eval_workflow_kwargs})
        workflow = EvalOrTrain(workflow, _build_one(evaluating, standard))
    if settings.should_accept_fn:
        accept = import_ref(settings.should_accept_fn)
        if not callable(accept):
            raise WorkflowError(f"should_accept_fn {settings.should_accept_fn!r} is a {type(accept).__name__}, not a function")
        workflow = Accepting(workflow, accept)
    return workflow


def _build_one(settings: RolloutSettings, standard: dict[str, Callable[[], Any]]) -> RolloutWorkflow:
    cls = import_ref(settings.workflow)
    if not (isinstance(cls, type) and cls.__module__.startswith("services.")):
        standard = {k: v for k, v in standard.items() if k not in _DEMO_STANDARD or k in settings.model_fields_set}
    kwargs = dict(settings.workflow_kwargs)
    if isinstance(kwargs.get("gconfig"), Mapping):  # from a config file: changes to the standard gconfig
        try:
            kwargs["gconfig"] = settings.gconfig.new(**kwargs["gconfig"])
        except TypeError as exc:
            raise WorkflowError(f"workflow_kwargs.gconfig: {exc}") from exc
    groups_itself = False
    if isinstance(cls, type) and issubclass(cls, RolloutWorkflow):
        params = inspect.signature(cls).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        accepted = set(standard) if takes_any else set(params) & set(standard)
        for name in accepted - set(kwargs):
            kwargs[name] = standard[name]()
        groups_itself = "group_size" in params
        kwargs = resolve_callable_kwargs(cls, kwargs, "workflow_kwargs")
    elif is_agent(cls):
        for name in _AGENT_STANDARD:
            if name not in kwargs:
                kwargs[name] = standard[name]()
    workflow: RolloutWorkflow = CheckedWorkflow(resolve_workflow(cls, kwargs))
    if not groups_itself and settings.group_size > 1:
        workflow = GroupedRolloutWorkflow(workflow, settings.group_size)
    return workflow


async def run(settings: RolloutSettings, bus: Bus) -> None:
    bind_context(worker=settings.worker)

    async def main(sup: Supervisor) -> None:
        from services.reward.client import RewardClient
        from services.rollout.engine import SGLangClient
        from services.rollout.reward_batching import CoalescingRewardClient

        nc = await bus.connect(f"rollout-{settings.worker}")
        sup.stack.push_async_callback(close_connection, nc)
        engine = SGLangClient(settings.inference, settings.trust.inference_keys())
        sup.stack.push_async_callback(engine.aclose)
        # the side port's /readyz: an inference server and a reward service (its micro-service name) answer
        # SGLang's /ready where it exists, else /health, which runs a test generation and waits out a pause
        urls = [url for server in settings.inference.servers for url in readiness_urls(server)]
        register_check("inference reachable", http_check(*urls, timeout_s=READY_POLL_TIMEOUT_S))
        register_check("reward reachable", nats_responder_check(nc, "$SRV.PING.jetrl-reward"))

        loaded: dict[str, Any] = {}

        def tokenizer() -> Any:
            if "tok" not in loaded:
                loaded["tok"] = load_pretrained_tokenizer(settings.model_path)
            return loaded["tok"]

        reward = CoalescingRewardClient(RewardClient(nc, settings.reward_timeout_s), settings.reward_batch_max_items)
        try:
            workflow = build_workflow(settings, standard_kwargs(settings, tokenizer, reward))
        except WorkflowError:
            raise
        except Exception as exc:
            raise WorkflowError(f"workflow {settings.workflow}: construction failed: {exc!r}") from exc
        dumper = None
        if settings.dump_root:
            decode = None
            if settings.model_path:
                tok = tokenizer()
                decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
            dumper = TrajectoryDumper(settings.dump_root, settings.experiment_name, settings.trial, decode)
        metrics = MetricsPublisher(nc, settings.run, "rollout", settings.worker)
        worker = RolloutWorker(nc, settings.run, workflow, engine, worker_config(settings), metrics=metrics, dumper=dumper,
                               bus=bus)
        log.info("rollout worker starting", workflow=type(workflow).__name__, max_concurrent=settings.max_concurrent)
        # Everything made so far (modules, the tokenizer: ~400k objects) lives as long as the process.
        # Frozen, the collector stops walking it: each full collection an episode's allocations set off
        # used to cost ~0.15 CPU-s, ~20% of a worker's CPU on short episodes (measured).
        gc.freeze()
        sup.spawn("worker", worker.run(sup.stopping))
        sup.spawn("metrics", worker.metrics_loop(sup.stopping, settings.metrics_interval_s))

    await supervise("rollout", main, settings.shutdown_timeout_s, retry=bus.retry)


def worker_config(settings: RolloutSettings) -> WorkerConfig:
    """The worker's part of the settings: every WorkerConfig field the settings have, under the same name."""
    return WorkerConfig(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(WorkerConfig)
                           if f.name in RolloutSettings.model_fields})
