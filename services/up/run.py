"""The body of `jetrl up`: start the stack, watch it, stop it, report."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from services.common.bus import connect, declare_streams, set_default_auth, set_default_declare
from services.common.logging import configure_logging, get_logger
from services.common.model_dirs import NotOurs, check_model_dir
from services.common.model_path import ModelNotFound, require_model
from services.common.nats_server import free_port
from services.common.settings import SettingsError, deep_merge
from services.runs import URL_FILE
from services.up import SERVICE_SECTIONS
from services.up.credentials import ADMIN, declare_as_admin, make_credentials
from services.up.display import Display
from services.up.layout import layout, priorities
from services.up.monitor import RunView, watch
from services.up.presets import preset_for, preset_name, summarize, summary_lines
from services.up.presets import section as preset_section
from services.up.report import last_error, write_metrics
from services.up.report import summary_lines as report_lines
from services.up.rundir import RunDirInUse, prepare_run_dir
from services.up.settings import UpSettings
from services.up.stack import Stack, settings_class, to_env
from services.up.trust import announce_trust

log = get_logger("up")
ROOT = Path(__file__).resolve().parents[2]
_PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TORCH_EXTENSIONS_DIR", "VIRTUAL_ENV")


def run_stack(settings: UpSettings, sections: dict[str, dict[str, Any]]) -> int:
    configure_logging(settings.log_level, settings.log_format, run=settings.run, service="up")
    try:
        # before anything starts: the model is here, and jetrl never writes into a user's model
        check_model_dir(require_model(settings.model_path))
        run_dir, kept = prepare_run_dir(Path(settings.run_dir), settings.run)
    except (RunDirInUse, NotOurs, ModelNotFound) as exc:
        print(f"jetrl up: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_run(settings, sections, run_dir, kept))


def passed_env(s: UpSettings, environ: Mapping[str, str]) -> dict[str, str]:
    """What of `jetrl up`'s environment every service gets: a fixed few, and `up.pass_env`."""
    return {k: environ[k] for k in (*_PASS_ENV, *s.pass_env) if k in environ}


def validate_sections(sections: dict[str, dict[str, Any]]) -> None:
    """Fail before starting anything if a service section has an unknown key or a bad value."""
    from pydantic import ValidationError

    for name, values in sections.items():
        try:
            settings_class(name).model_validate(values)
        except ValidationError as exc:
            raise SettingsError(f"--config section {name!r}: {exc}") from exc


DEMO_STOP_AT_REWARD = 0.9
"""Where the demo stops unless `stop_at_reward` says otherwise: copy3 is learned (a 10-step mean reward
of 0.9; chance is ~0.02)."""


def stop_at_reward(s: UpSettings) -> float:
    """The 10-step mean reward that ends the run (0: none)."""
    if s.stop_at_reward is not None:
        return s.stop_at_reward
    return 0.0 if s.dataset_path else DEMO_STOP_AT_REWARD


async def _run(s: UpSettings, sections: dict[str, dict[str, Any]], run_dir: Path, kept: Path | None) -> int:
    stop = asyncio.Event()
    interrupted: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        interrupted.append(sig.name)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    started = time.time()
    # the run's NATS users and inference admin key (credentials.py); an open bus only when asked
    creds = make_credentials(run_dir, s.run, locked=s.bus == "embedded" and not s.open_bus)
    nats = creds.nats_server(run_dir / "nats", run_dir / "nats-server.log") if s.bus == "embedded" else None
    base_env = passed_env(s, os.environ)
    # PYTHONPATH: jetrl's root, then the caller's own when `up.pass_env` names it (a workflow's package)
    extra_path = [os.environ["PYTHONPATH"]] if "PYTHONPATH" in s.pass_env and os.environ.get("PYTHONPATH") else []
    base_env.update(PYTHONPATH=os.pathsep.join([str(ROOT), *extra_path]), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                    TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    base_env["JETRL_RUN_DIR"] = str(run_dir)  # marks every process of the run, children included
    stack = Stack(run_dir, base_env)
    view = RunView(started=started, target=stop_at_reward(s) or None)
    display = Display(s, view, stack)
    outcome = "failed"
    used: dict[str, Any] = {}
    try:
        if nats is not None:
            nats.start()
            url = nats.url
            log.info("nats-server ready", url=url, store=str(nats.store_dir), users=creds.locked)
            if not creds.locked:
                log.warning("open_bus: the bus admits anyone on this host without credentials: any process here can "
                            "read the prompts, publish groups that are trained and announce weights", url=url)
        else:
            url = s.nats_url
            log.info("using the NATS at nats_url", url=url, replicas=s.nats_replicas)
        (run_dir / URL_FILE).write_text(url)  # lets `jetrl status` / `plot` find the live run
        await asyncio.to_thread(_make_model, s.model_path)
        dataset, task_eval = await asyncio.to_thread(_dataset, s, run_dir)
        # `up`'s own connection (the monitor): its nats_auth; with bus_declare=false (a restricted user
        # on an external bus) it only checks that `jetrl bus init` declared the streams
        if creds.locked:  # the streams and the bucket declared once as the admin; then watched as the observer
            await declare_as_admin(url, creds.auth(ADMIN), s.nats_replicas, trajectories_max_bytes=s.recording_max_bytes,
                                   trajectories_discard=s.recording_discard)
            set_default_auth(creds.auth("observer"))
            set_default_declare(False)
        else:
            set_default_auth(s.nats_auth)
            set_default_declare(s.bus_declare)
        nc = await connect(url, "jetrl-up")
        await declare_streams(nc.jetstream(), replicas=s.nats_replicas)
        await watch(nc, s.run, view)

        shape = layout(s)
        log.info("process layout", cores=shape.cores, rollout_workers=shape.rollout_workers, torch_threads=shape.torch_threads)
        threads = {"OMP_NUM_THREADS": str(shape.torch_threads)}  # the trainer's and the servers' tensor work
        common = {"run": s.run, "nats_url": url, "nats_replicas": s.nats_replicas, "log_format": "json"}
        preset = preset_for(s.dataset_path)  # the copy3 demo's settings, for the demo only (presets.py)
        # the run's credentials under the preset under the user's own section (theirs win)
        sec = lambda name: deep_merge(creds.section(name, sections.get(name, {})), preset_section(preset, sections, name))  # noqa: E731
        # Ports first, so that every service is told where the servers will be before any of them is up.
        servers = [f"http://127.0.0.1:{free_port()}" for _ in range(s.inference_servers)]
        signed = announce_trust(run_dir, sections)  # the trainer signs announcements, the agents check them
        trainer: dict[str, Any] = {
            **common,
            **signed,
            "model_path": s.model_path,
            "output_dir": str(run_dir / "trainer"),
            "total_steps": s.total_steps,
            "feeder": {"dataset_path": dataset},
            # Weights travel in memory to the servers it started (docs/weights.md): on this host, through
            # shared memory (`colocated`), unless they are simulated (no model to receive into: then the
            # disk path, as `trainer.weights_broadcast.enabled: false` selects).
            "weights_broadcast": {"enabled": not _simulated(sec("inference")), "servers": servers, "transport": "colocated"},
        }
        stack.nice = priorities(s, broadcast=bool(deep_merge(trainer, sec("trainer"))["weights_broadcast"].get("enabled")))
        if not s.dataset_path:  # the demo: a fixed eval set of 32 prompts, every 10 steps
            eval_set = await asyncio.to_thread(_make_dataset, run_dir, 32, "copy3-eval.jsonl", 1)
            trainer["feeder"] |= {"eval_dataset_path": str(eval_set), "eval_every": 10, "eval_size": 32}
        elif task_eval is not None:  # a generated task's held-out rows, for a trainer section's `feeder.eval_every`
            trainer["feeder"]["eval_dataset_path"] = str(task_eval)
        used = _print_settings(s, {"trainer": deep_merge(trainer, sec("trainer")), "rollout": sec("rollout"),
                                   "inference": sec("inference")})
        # The trainer first: its start (DeepSpeed's import and init, the model) is the longest of all and
        # needs no inference server, so it overlaps the servers' start instead of following it. Its
        # prompts wait in the PROMPTS stream until a rollout worker is up.
        trainer_proc = stack.start("trainer", "services.trainer", to_env("trainer", deep_merge(trainer, sec("trainer"))) | threads)
        stack.start("reward", "services.reward", to_env("reward", deep_merge(common, sec("reward"))))
        for i, url in enumerate(servers):
            port = int(url.rsplit(":", 1)[1])
            stack.start(
                f"inference-{i}",
                "services.inference",
                to_env(
                    "inference",
                    # skip_tokenizer_init: ids only, as jetrl starts real SGLang (the rollout client
                    # decodes and applies stop strings itself): no detokenizing per reply
                    deep_merge({**common, "model_path": s.model_path, "port": port, "seed": i,
                                "torch_threads": shape.torch_threads, "skip_tokenizer_init": True}, sec("inference")),
                )
                | threads,
            )
            weights = {**common, **signed, "server": url, "cache_dir": str(run_dir / f"weights-cache-{i}")}
            stack.start(f"weights-{i}", "services.weights", to_env("weights", deep_merge(weights, sec("weights"))))
        # The rollout workers start beside the servers too: their start (imports, the tokenizer) overlaps
        # the servers' model load, and each takes no prompt before a server serves (version_gate.py).
        for i in range(shape.rollout_workers):
            rollout = {**common, "model_path": s.model_path, "worker": f"rollout-{i}", "inference": {"servers": servers}}
            # replicas: one dying is survivable (its prompts are redelivered); all of them is not
            stack.start(f"rollout-{i}", "services.rollout", to_env("rollout", deep_merge(rollout, sec("rollout"))), required=False)
        if "track" in sections:  # experiment trackers: a follower of the METRICS stream; losing it loses no training
            config = run_dir / "config.json"
            config.write_text(json.dumps({"up": s.model_dump(), **{n: sec(n) for n in SERVICE_SECTIONS if n != "track"}}, default=str))
            track = {**common, "config_path": str(config)}
            stack.start("track", "services.track", to_env("track", deep_merge(track, sec("track"))), required=False)

        # A server that dies or never loads is reported here, with its log, before the live display.
        await _wait_healthy(servers, stack, s.ready_timeout_s, stop)

        with display:
            while not stop.is_set():
                display.refresh()
                if trainer_proc.poll() == 0:
                    outcome = "finished"
                    break
                failed = stack.failed() or stack.all_ended("rollout-")
                for lost in stack.newly_ended("rollout-"):
                    log.warning(
                        "rollout worker ended; the others go on and its prompts are redelivered",
                        service=lost.name,
                        code=lost.poll(),
                        log_tail=lost.log_tail(5),
                    )
                if failed is not None:
                    display.stop()
                    print(f"\njetrl up: service {failed.name} exited with code {failed.poll()}; "
                          f"last lines of {failed.log_path}:\n{failed.log_tail()}", file=sys.stderr)
                    print(last_error(failed.log_path), file=sys.stderr)
                    break
                if view.reached_at is not None:
                    outcome = "converged"
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
            if interrupted:
                outcome = f"interrupted ({interrupted[0]})"
        await asyncio.sleep(0.3)  # let the last metrics events arrive
        await nc.close()
    finally:
        log.info("stopping the stack", outcome=outcome)
        await asyncio.to_thread(stack.stop, s.stop_timeout_s)
        if nats is not None:
            nats.stop()
        (run_dir / URL_FILE).unlink(missing_ok=True)
    wall = time.time() - started
    extra = {"outcome": outcome, "reached_at_step": view.reached_at, "wall_s": wall, "started_at": started,
             "servers": view.servers, "evals": view.evals, "settings": used, "workflow_stats": view.workflow_stats,
             "rollout_outcomes": view.episode_outcomes()}
    write_metrics(run_dir, view.steps, extra)
    from services.up.curves import plot_curves  # numpy: imported when the run is over, not before its start

    png = plot_curves(run_dir, view.steps, f"jetrl up: run {s.run} ({outcome})", view.evals)
    summary = [f"run {s.run}: {outcome}", *report_lines(view.steps, view.servers, wall, view.episode_outcomes())]
    if view.reached_at is not None:
        at = next(st for st in view.steps if st["step"] == view.reached_at)
        summary.insert(1, f"reached a 10-step mean reward of {view.target} at step {view.reached_at}, {at['time']:.1f} s after the start")
    if kept is not None:
        summary.append(f"previous run {s.run}: {kept}")
    print("\n".join([*summary, f"metrics: {run_dir / 'metrics.json'}", f"curve: {png}", f"logs: {run_dir / 'logs'}"]))
    if outcome in ("finished", "converged"):
        return 0
    return 130 if interrupted else 1


def _simulated(inference: dict[str, Any]) -> bool:
    """Whether the inference section asks for simulated servers (read as the server reads it)."""
    return bool(getattr(settings_class("inference").model_validate(inference), "simulate", False))


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
    effective = summarize({name: settings_class(name).model_validate(values) for name, values in merged.items()})
    print("\n".join(summary_lines(effective, preset_name(s.dataset_path))), flush=True)
    return {"preset": preset_name(s.dataset_path), **effective}


def _make_dataset(run_dir: Path, n: int, name: str = "copy3.jsonl", seed: int = 0) -> Path:
    from services.common.demo_task import write_copy3_dataset

    return write_copy3_dataset(run_dir / "data" / name, n, seed)


async def _wait_healthy(servers: list[str], stack: Stack, timeout_s: float, stop: asyncio.Event) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        for url in servers:
            while True:
                failed = stack.failed()
                if failed is not None:
                    raise RuntimeError(f"{failed.name} exited with {failed.poll()} while starting:\n{failed.log_tail()}")
                if stop.is_set():
                    raise RuntimeError("interrupted while starting")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{url}/health")).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"inference server {url} not healthy within {timeout_s}s")
                await asyncio.sleep(0.2)
