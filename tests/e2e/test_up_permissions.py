"""The whole pipeline over TLS with one NATS user per service, each allowed only its subjects (the users block
`jetrl bus permissions` generates): `jetrl bus init` declares the bus as the admin, then `jetrl up
bus=external` runs trainer, rollout workers, reward, weights agent, inference and tracker as their
restricted users (`bus_declare=false`). The run trains, the server logs no permission violation, and
each service's forbidden publish is refused by the server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.headers import prompt_headers
from schemas.messages import PromptTask, encode
from schemas.subjects import PROMPTS_STREAM, Subjects
from services.bus.nats_server import NatsServer
from services.bus.permissions import authorization_block
from services.common.bus import connect, publish_acked
from services.common.nats_auth import NatsAuth
from tests.support.bus_users import as_user, bus_init, make_pki, refusal, write_secrets
from tests.support.up import ROOT, finish, start_up

RUN = "perm"
STEPS = 4


async def push_prompts(url: str, password_file: str, n: int, ca: Path) -> None:
    nc = await connect(url, "push", auth=NatsAuth(user="prompts", password_file=password_file, tls_ca_file=str(ca)))
    try:
        for i in range(n):
            task = PromptTask(run=RUN, prompt_id=f"left-{i}", data={"prompt": "abc", "answer": "abc"})
            await publish_acked(nc.jetstream(), Subjects(RUN).prompts_train, encode(task), timeout_s=10,
                                headers=prompt_headers(RUN, task.prompt_id), stream=PROMPTS_STREAM)
    finally:
        await nc.close()


def violations(server: NatsServer) -> list[str]:
    return [line for line in server.log_file.read_text().splitlines() if "Violation" in line]


@pytest.mark.timeout(900)
def test_pipeline_runs_as_restricted_users(tmp_path: Path) -> None:
    passwords, files = write_secrets(tmp_path / "secrets")
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    ca = pki["ca.pem"]
    tls = f'\ntls {{\n  cert_file: "{pki["server.pem"]}"\n  key_file: "{pki["server.key"]}"\n  timeout: 2\n}}\n'
    server = NatsServer(tmp_path / "nats", extra_conf=authorization_block(RUN, passwords) + tls).start()
    try:
        init = bus_init(server.url, files, ca)
        assert init.returncode == 0, init.stderr[-3000:]
        assert "PROMPTS: created" in init.stdout and "bucket WEIGHTS: created" in init.stdout, init.stdout
        config = {
            "up": {"bus": "external", "nats_url": server.url, **as_user(files, "observer", ca)},
            "trainer": {"eta": 4, "checkpoint_every": 0, **as_user(files, "trainer", ca)},
            "rollout": {"ack_wait_s": 15, **as_user(files, "rollout", ca)},
            "reward": as_user(files, "reward", ca),
            "weights": as_user(files, "weights", ca),
            "track": {**as_user(files, "track", ca), "tensorboard": {"log_dir": str(tmp_path / "tb")}},
        }
        # leftovers of an earlier incarnation, pushed as the `prompts` user: the trainer purges them
        asyncio.run(push_prompts(server.url, files["prompts"], 3, ca))
        proc = start_up(tmp_path, RUN, STEPS, config)
        out = finish(proc, timeout=600)
        assert proc.returncode == 0, out[-4000:]
        assert f"step {STEPS}/{STEPS}" in out, out[-3000:]
        assert violations(server) == [], violations(server)
        trainer_log = (tmp_path / RUN / "logs" / "trainer.log").read_text()
        # answered by a rollout worker started before the trainer, or still queued and purged
        afresh = json.loads(next(line for line in trainer_log.splitlines() if "starting it afresh" in line))
        assert afresh["recorded_trajectories_ignored"] + afresh["queued_prompts_dropped"] == 3, afresh
        status = subprocess.run(
            [sys.executable, "-m", "services.cli", "status", f"run={RUN}", f"nats_url={server.url}",
             "nats_auth.user=observer", f"nats_auth.password_file={files['observer']}", f"nats_auth.tls_ca_file={ca}"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
        )
        assert status.returncode == 0, status.stderr[-3000:]
        assert violations(server) == [], violations(server)
        logs = "".join(p.read_text() for p in (tmp_path / RUN / "logs").glob("*.log"))
        for user, pw in passwords.items():
            assert pw not in logs and pw not in out, f"{user}'s password was logged"
    finally:
        server.stop()


# (user, subject) publishes the server must refuse: each service kept to its own part of the bus.
FORBIDDEN_PUBLISH = [
    ("rollout", f"jetrl.{RUN}.weights.published"),  # forging a weights announcement
    ("rollout", f"jetrl.{RUN}.prompts.train"),  # issuing prompts
    ("rollout", "jetrl.other.trajectories"),  # another run's trajectories
    ("rollout", "$JS.API.STREAM.DELETE.TRAJECTORIES"),
    ("rollout", f"$JS.API.CONSUMER.DELETE.PROMPTS.rollout-{RUN}"),
    ("reward", f"jetrl.{RUN}.trajectories"),
    ("reward", f"jetrl.{RUN}.weights.published"),
    ("reward", "jetrl.reward.score"),
    ("weights", f"jetrl.{RUN}.weights.published"),
    ("weights", f"jetrl.{RUN}.prompts.train"),
    ("weights", "$JS.API.STREAM.PURGE.OBJ_WEIGHTS"),
    ("track", f"jetrl.{RUN}.metrics.trainer"),
    ("track", f"jetrl.{RUN}.trajectories"),
    ("track", "$JS.API.STREAM.PURGE.METRICS"),
    ("observer", f"$JS.API.CONSUMER.DELETE.TRAJECTORIES.trainer-{RUN}"),
    ("observer", f"$JS.API.CONSUMER.CREATE.TRAJECTORIES.trainer-{RUN}.jetrl.{RUN}.trajectories"),
    ("observer", "$JS.API.STREAM.PURGE.PROMPTS"),
    ("trainer", f"jetrl.{RUN}.trajectories"),  # the trainer cannot forge what it trains on
    ("trainer", "$JS.API.STREAM.DELETE.TRAJECTORIES"),
    ("trainer", f"$JS.API.CONSUMER.DELETE.PROMPTS.rollout-{RUN}"),
    ("prompts", f"jetrl.{RUN}.weights.published"),
    ("prompts", "$JS.API.STREAM.CREATE.EVIL"),
]
FORBIDDEN_SUBSCRIBE = [
    ("rollout", "jetrl.reward.score"),  # stealing the reward's requests
    ("track", f"jetrl.{RUN}.prompts.>"),
    ("weights", f"jetrl.{RUN}.trajectories"),
    ("observer", "jetrl.reward.score"),
    ("rollout", "_INBOX.>"),  # reading every service's replies (JetStream API answers, pulled messages)
    ("rollout", "_INBOX.trainer.>"),  # ... or the trainer's
    ("reward", "_INBOX.rollout.>"),
    ("observer", "_INBOX.>"),
]

ALLOWED = [
    ("rollout", "publish", f"jetrl.{RUN}.trajectories"),
    ("rollout", "publish", f"jetrl.{RUN}.trajectories.eval"),
    ("trainer", "publish", f"jetrl.{RUN}.prompts.eval"),
    ("trainer", "publish", "$JS.API.STREAM.PURGE.PROMPTS"),  # (a body that is no request: nothing purged)
    ("trainer", "subscribe", f"jetrl.{RUN}.trajectories.eval"),
    ("trainer", "subscribe", f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.PROMPTS.rollout-{RUN}"),
    ("weights", "publish", f"jetrl.{RUN}.weights.failed.http___127_0_0_1_30000"),
    ("prompts", "publish", f"jetrl.{RUN}.prompts.train"),
    ("observer", "subscribe", f"jetrl.{RUN}.metrics.>"),
    ("rollout", "subscribe", "_INBOX.rollout.abc"),  # its own replies
]


@pytest.mark.timeout(300)
def test_each_forbidden_publish_is_refused(tmp_path: Path) -> None:
    passwords, files = write_secrets(tmp_path / "secrets")
    server = NatsServer(tmp_path / "nats", extra_conf=authorization_block(RUN, passwords)).start()
    try:
        assert bus_init(server.url, files).returncode == 0

        async def check() -> list[str]:
            wrong = []
            for action, cases in (("publish", FORBIDDEN_PUBLISH), ("subscribe", FORBIDDEN_SUBSCRIBE)):
                for user, subject in cases:
                    err = await refusal(server.url, user, passwords[user], action, subject)
                    verb = "publish to" if action == "publish" else "subscription to"
                    if f'permissions violation for {verb} "{subject.lower()}"' not in err.lower():
                        wrong.append(f"{user} {action} {subject}: {err or 'not refused'}")
            # and what each needs still goes through (the eval paths included, which a short run may not
            # reach); each waits 5 s for an error that should never come, so they wait together
            errs = await asyncio.gather(*(refusal(server.url, user, passwords[user], action, subject)
                                          for user, action, subject in ALLOWED))
            wrong += [f"{user} {action} {subject} refused: {err}"
                      for (user, action, subject), err in zip(ALLOWED, errs, strict=True) if err]
            return wrong

        assert asyncio.run(check()) == []
        logged = "\n".join(violations(server))
        for user, subject in FORBIDDEN_PUBLISH:
            assert f'"$G/user:{user}" - Publish Violation - Subject "{subject}"' in logged
    finally:
        server.stop()
