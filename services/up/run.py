"""The body of `jetrl up`: start the stack, watch it, stop it, report."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from services.bus.nats_server import NatsServer
from services.common.bus import Bus, close_connection
from services.common.logging import get_logger
from services.runs import MONITOR_URL_FILE, URL_FILE
from services.up.compose import compose
from services.up.credentials import ADMIN, RunCredentials, adopt_issuer_key, declare_as_admin, make_credentials
from services.up.device import summary as device_summary
from services.up.display import Display
from services.up.layout import layout, priorities
from services.up.monitor import RunView, watch
from services.up.plan import execute
from services.up.presets import preset_name, summarize, summary_lines
from services.up.report import last_error, workflow_stats_line, write_metrics
from services.up.report import summary_lines as report_lines
from services.up.settings import UpSettings
from services.up.stack import Proc, Stack, settings_class
from services.up.store import StoreWatch

log = get_logger("up")


DEMO_STOP_AT_REWARD = 0.9
"""Where the demo stops unless `stop_at_reward` says otherwise: copy3 is learned (a 10-step mean reward
of 0.9; chance is ~0.02)."""


def stop_at_reward(s: UpSettings) -> float:
    """The 10-step mean reward that ends the run (0: none)."""
    if s.stop_at_reward is not None:
        return s.stop_at_reward
    return 0.0 if s.dataset_path else DEMO_STOP_AT_REWARD


async def run(s: UpSettings, sections: dict[str, dict[str, Any]], run_dir: Path, kept: Path | None, stack: Stack,
              started: float) -> int:
    """The run, once launch.py has checked what it could and started the fork server (`started`: when
    it began): the bus, the services, the live display until the trainer ends, the stop and the report."""
    stop = asyncio.Event()
    interrupted: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        interrupted.append(sig.name)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    shape = layout(s)
    # the run's NATS users and inference admin key (credentials.py); an open bus only when asked
    creds = make_credentials(run_dir, s.run, locked=s.bus == "embedded" and not s.open_bus)
    if (var := adopt_issuer_key(creds, os.environ)) is not None:  # the user's key, not a second one beside it
        log.info("the trainer checks pushed prompts with your prompt issuer key; jetrl prompts push --run finds it",
                 set_by=var, kept_as=str(creds.dir / "prompt-issuer-key"))
    nats = creds.nats_server(run_dir / "nats", run_dir / "nats-server.log") if s.bus == "embedded" else None
    view = RunView(started=started, target=stop_at_reward(s) or None, eval_lift=s.stop_at_eval_lift)
    display = Display(s, view, stack)
    outcome = "failed"
    used: dict[str, Any] = {}
    store: StoreWatch | None = None
    try:
        url = _bus_url(s, nats, creds)
        if nats is not None:
            store = StoreWatch(nats, view.store, s.store_restart_free_bytes)  # a full disk: shown, and recovered from
            (run_dir / MONITOR_URL_FILE).write_text(store.monitor_url)
        (run_dir / URL_FILE).write_text(url)  # lets `jetrl status` / `plot` find the live run
        await asyncio.to_thread(_make_model, s.model_path)
        dataset, task_eval = await asyncio.to_thread(_dataset, s, run_dir)
        nc = await _monitor(s, creds, url, view)

        log.info("process layout", cores=shape.cores, rollout_workers=shape.rollout_workers, torch_threads=shape.torch_threads,
                 **({"trainer_cpus": list(shape.trainer_cpus), "other_cpus": list(shape.other_cpus),
                     "beside_trainer": sorted(m.removeprefix("services.") for m in shape.beside_trainer)} if shape.trainer_cpus else {}))
        # the demo: a fixed eval set of 32 prompts, every 10 steps; a generated task: its held-out rows
        eval_set = await asyncio.to_thread(_make_dataset, run_dir, 32, "copy3-eval.jsonl", 1) if not s.dataset_path else task_eval
        composed = compose(s, sections, creds, run_dir, url, shape, dataset, eval_set, store.monitor_url if store else None)
        stack.nice = priorities(s, broadcast=composed.broadcast)
        stack.cpus = shape.cpus
        used = _print_settings(s, composed.learning)
        procs = await execute(composed.plan, stack, s.ready_timeout_s, stop)
        outcome = await _follow(display, stack, view, procs["trainer"], stop, store)
        if interrupted:
            outcome = f"interrupted ({interrupted[0]})"
        # the last metrics events: a round trip brings every one the server routed here, then the
        # subscriptions' queues are emptied (the drain), bounded
        await close_connection(nc)
    finally:
        log.info("stopping the stack", outcome=outcome)
        await asyncio.to_thread(stack.stop, s.stop_timeout_s)
        if nats is not None:
            nats.stop()
        (run_dir / URL_FILE).unlink(missing_ok=True)
        (run_dir / MONITOR_URL_FILE).unlink(missing_ok=True)
    return _report(s, run_dir, kept, view, outcome, started, used, interrupted)


def _bus_url(s: UpSettings, nats: NatsServer | None, creds: RunCredentials) -> str:
    """Start the embedded nats-server (readiness: its /healthz), or use `nats_url`; returns the URL."""
    if nats is None:
        log.info("using the NATS at nats_url", url=s.nats_url, replicas=s.nats_replicas)
        return s.nats_url
    nats.start()
    log.info("nats-server ready", url=nats.url, store=str(nats.store_dir), users=creds.locked)
    if not creds.locked:
        log.warning("open_bus: the bus admits anyone on this host without credentials: any process here can "
                    "read the prompts, publish groups that are trained and announce weights", url=nats.url)
    return nats.url


async def _monitor(s: UpSettings, creds: RunCredentials, url: str, view: RunView) -> NATS:
    """`up`'s own connection, watching the run. A locked run: the streams and the bucket declared once
    as the admin, then watched as the observer. Else its nats_auth; with bus_declare=false (a restricted
    user on an external bus) it only checks that `jetrl bus init` declared the streams."""
    if creds.locked:
        await declare_as_admin(url, creds.auth(ADMIN), s.nats_replicas, trajectories_max_bytes=s.recording_max_bytes,
                               trajectories_discard=s.recording_discard)
        bus = Bus(url, creds.auth("observer"), s.nats_replicas, declare=False)
    else:
        bus = Bus(url, s.nats_auth, s.nats_replicas, s.bus_declare)
    nc = await bus.connect("jetrl-up")
    await bus.declare_streams(nc.jetstream())
    await watch(nc, s.run, view)
    return nc


async def _follow(display: Display, stack: Stack, view: RunView, trainer: Proc, stop: asyncio.Event,
                  store: StoreWatch | None) -> str:
    """The live display until the trainer finishes, the reward target is reached, a required service
    fails (its log tail printed) or `stop` is set; returns the outcome."""
    with display:
        while not stop.is_set():
            if store is not None:
                await store.check()
            display.refresh()
            if trainer.poll() == 0:
                return "finished"
            failed = stack.failed() or stack.all_ended("rollout-")
            for lost in stack.newly_ended("rollout-"):
                log.warning("rollout worker ended; the others go on and its prompts are redelivered", service=lost.name,
                            code=lost.poll(), log_tail=lost.log_tail(5))
            if failed is not None:
                display.stop()
                print(f"\njetrl up: service {failed.name} exited with code {failed.poll()}; "
                      f"last lines of {failed.log_path}:\n{failed.log_tail()}", file=sys.stderr)
                print(last_error(failed.log_path), file=sys.stderr)
                return "failed"
            if view.reached_at is not None or view.lifted_at is not None:
                return "converged"
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
    return "failed"


def _report(s: UpSettings, run_dir: Path, kept: Path | None, view: RunView, outcome: str, started: float,
            used: dict[str, Any], interrupted: list[str]) -> int:
    """metrics.json, the curve and the summary; the exit code."""
    wall = time.time() - started
    extra = {"outcome": outcome, "reached_at_step": view.reached_at, "lifted_at_step": view.lifted_at, "wall_s": wall,
             "started_at": started,
             "servers": view.servers, "evals": view.evals, "settings": used, "workflow_stats": view.workflow_stats,
             "rollout_outcomes": view.episode_outcomes(),
             "store": {"times_full": view.store.times_full, "nats_restarts": view.store.restarts, "full_at_end": view.store.full}}
    write_metrics(run_dir, view.steps, extra)
    from services.up.curves import plot_curves, plot_workflow_stats  # numpy: imported when the run is over

    png = plot_curves(run_dir, view.steps, f"jetrl up: run {s.run} ({outcome})", view.evals)
    stats_png = plot_workflow_stats(run_dir, view.workflow_stats, f"jetrl up: workflow statistics of run {s.run}")
    stats_text = workflow_stats_line(view.workflow_stats)
    summary = [f"run {s.run}: {outcome}", *report_lines(view.steps, view.servers, wall, view.episode_outcomes()),
               *([stats_text] if stats_text else [])]
    if view.reached_at is not None:
        at = next(st for st in view.steps if st["step"] == view.reached_at)
        summary.insert(1, f"reached a 10-step mean reward of {view.target} at step {view.reached_at}, {at['time']:.1f} s after the start")
    if view.lifted_at is not None:
        trained = next((f"{st['time']:.1f} s" for st in view.steps if st["step"] == view.lifted_at), "?")
        summary.insert(1, f"eval pass rate {view.eval_at(0) or 0:.3f} at step 0 -> {view.eval_at(view.lifted_at) or 0:.3f} at step "
                          f"{view.lifted_at} (+{view.eval_lift}), that step trained {trained} after the start")
    if view.store.times_full:
        summary.append(f"store: full {sum(view.store.times_full.values())} time(s) ({', '.join(sorted(view.store.times_full))}); "
                       f"nats-server restarted {view.store.restarts} time(s) after space returned")
    if kept is not None:
        summary.append(f"previous run {s.run}: {kept}")
    stats_line = [f"workflow statistics: {stats_png}"] if stats_png else []
    print("\n".join([*summary, f"metrics: {run_dir / 'metrics.json'}", f"curve: {png}", *stats_line, f"logs: {run_dir / 'logs'}"]))
    if outcome in ("finished", "converged"):
        return 0
    return 130 if interrupted else 1


def _make_model(path: str) -> None:
    from services.inference.make_model import ensure_model

    ensure_model(path)


def _dataset(s: UpSettings, run_dir: Path) -> tuple[str, Path | None]:
    """The training prompts (and a generated task's eval set): the demo's copy3 prompts without a
    `dataset_path`, a generated task's with `task:<name>` (services/common/arith_task.py), else the path."""
    if not s.dataset_path:
        return str(_make_dataset(run_dir, s.dataset_size)), None
    if s.dataset_path.startswith("task:"):
        from services.common.arith_task import write_task

        train, held_out = write_task(s.dataset_path.removeprefix("task:"), run_dir / "data", s.dataset_size)
        return str(train), held_out
    return s.dataset_path, None


def _print_settings(s: UpSettings, merged: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The effective settings of the services that decide what is learned: printed, and returned for metrics.json."""
    validated = {name: settings_class(name).model_validate(values) for name, values in merged.items()}
    effective = {"up": device_summary(s), **summarize(validated)}  # up's own: where the run computes
    print("\n".join(summary_lines(effective, preset_name(s.dataset_path))), flush=True)
    return {"preset": preset_name(s.dataset_path), **effective}


def _make_dataset(run_dir: Path, n: int, name: str = "copy3.jsonl", seed: int = 0) -> Path:
    from services.common.demo_task import write_copy3_dataset

    return write_copy3_dataset(run_dir / "data" / name, n, seed)
