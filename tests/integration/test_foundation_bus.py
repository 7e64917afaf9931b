"""The bus foundation against a real nats-server: idempotent stream declaration, poison messages
terminated and counted while the service goes on, SIGTERM shutdown inside its deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from schemas.messages import MetricsEvent, PromptTask, decode, encode
from schemas.subjects import METRICS_STREAM, PROMPTS_STREAM, Subjects, stream_specs
from services.common.bus import connect, declare_streams

ROOT = Path(__file__).resolve().parents[2]


async def test_streams_declared_twice_are_unchanged(nats_url: str) -> None:
    nc = await connect(nats_url, "t")
    js = nc.jetstream()
    first = await declare_streams(js)
    assert set(first.values()) == {"created"}
    before = {s.name: (await js.stream_info(s.name)).config for s in stream_specs()}
    second = await declare_streams(js)
    assert set(second.values()) == {"unchanged"}
    after = {s.name: (await js.stream_info(s.name)).config for s in stream_specs()}
    assert before == after
    # a changed limit is applied, then stable again
    changed = await declare_streams(js, stream_specs(trajectories_max_bytes=1 << 30))
    assert changed["TRAJECTORIES"] == "updated"
    assert (await js.stream_info("TRAJECTORIES")).config.max_bytes == 1 << 30
    await nc.close()


def start_echo(nats_url: str, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JETRL_ECHO__NATS_URL": nats_url}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.echo_service", "run=t1", "log_format=json", *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "echo: ready" in line, proc.stderr.read() if proc.poll() is not None else line
    return proc


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


async def test_malformed_message_is_terminated_and_counted_and_service_goes_on(nats_url: str) -> None:
    proc = start_echo(nats_url)
    try:
        nc = await connect(nats_url, "t")
        js = nc.jetstream()
        subjects = Subjects("t1")
        done = await nc.subscribe("echo.t1.done")
        metrics = await js.pull_subscribe(subjects.metrics_all, stream=METRICS_STREAM)

        await js.publish(subjects.prompts_train, b"\x00 definitely not msgpack")
        await js.publish(subjects.prompts_train, encode(PromptTask(run="t1", prompt_id="good-1", data={})))
        reply = await done.next_msg(timeout=10)
        assert reply.data == b"good-1"  # the service went on past the poison message

        event = decode(MetricsEvent, (await metrics.fetch(1, timeout=10))[0].data)
        assert event.values["malformed_messages"] == 1.0

        info = await js.consumer_info(PROMPTS_STREAM, subjects.rollout_consumer)
        assert info.num_ack_pending == 0 and info.num_redelivered == 0  # terminated, not retried
        assert (await js.stream_info(PROMPTS_STREAM)).state.messages == 0
        await nc.close()
        assert proc.poll() is None
    finally:
        stop(proc)


def test_sigterm_drains_and_exits_cleanly(nats_url: str) -> None:
    proc = start_echo(nats_url, "shutdown_timeout_s=5")
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        assert "echo: drained" in out
    finally:
        stop(proc)


def test_sigterm_deadline_cancels_a_stuck_task(nats_url: str) -> None:
    proc = start_echo(nats_url, "shutdown_timeout_s=1.5", "stuck_task=true")
    try:
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
        elapsed = time.monotonic() - start
        assert proc.returncode == 0, err
        assert "did not finish before the deadline" in err
        assert elapsed < 1.5 + 4.0  # the deadline plus interpreter exit, never hanging
    finally:
        stop(proc)


def test_failing_task_fails_the_service_fast(nats_url: str) -> None:
    # nats_url points at a server, but the port below does not: connect fails -> exit 1 with the error
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.echo_service", "nats_url=nats://127.0.0.1:1", "log_format=json", "connect_timeout_s=2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        input=None,
    )
    assert proc.returncode == 1
    assert "cannot connect to NATS" in proc.stderr
