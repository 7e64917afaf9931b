"""`jetrl up` signs its weights announcements with a key of the run's own."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from services.up.stack import to_env
from services.up.trust import announce_trust


def test_the_run_gets_one_private_key_the_trainer_and_agents_share(tmp_path: Path) -> None:
    signed = announce_trust(tmp_path, {})
    key_file = Path(signed["trust"]["announce_key_file"])
    key = key_file.read_text().strip()
    assert len(key) >= 32
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert announce_trust(tmp_path, {}) == signed and key_file.read_text().strip() == key, "a resumed run keeps its key"
    trainer_env = to_env("trainer", signed)
    weights_env = to_env("weights", signed)
    assert trainer_env["JETRL_TRAINER__TRUST__ANNOUNCE_KEY_FILE"] == weights_env["JETRL_WEIGHTS__TRUST__ANNOUNCE_KEY_FILE"] == str(key_file)
    assert key not in str(trainer_env), "the key goes by file, never in the environment"


def test_a_key_in_the_config_wins(tmp_path: Path) -> None:
    assert announce_trust(tmp_path, {"weights": {"trust": {"announce_key_file": "/run/k"}}}) == {}
    assert announce_trust(tmp_path, {"trainer": {"trust": {"announce_key": "k"}}}) == {}
    assert not (tmp_path / "announce-key").exists()


def test_each_service_gets_its_own_user_and_the_config_wins(tmp_path: Path) -> None:
    from services.up.credentials import make_credentials

    creds = make_credentials(tmp_path, "r")
    rollout = creds.section("rollout", {})
    assert rollout == {"nats_auth": {"user": "rollout", "password_file": str(tmp_path / "secrets" / "rollout")}, "bus_declare": False}
    assert creds.section("inference", {}) == {"admin_api_key_file": str(creds.admin_key_file)}
    assert creds.section("weights", {})["trust"] == {"inference_admin_api_key_file": str(creds.admin_key_file)}
    own = {"nats_auth": {"user": "me"}, "trust": {"inference_admin_api_key_file": "/k", "prompt_issuer_key": "x"}}
    assert creds.section("trainer", own) == {}
    assert creds.section("inference", {"admin_api_key": "k"}) == {}
    password = (tmp_path / "secrets" / "trainer").read_text()
    assert make_credentials(tmp_path, "r").section("trainer", {}) == creds.section("trainer", {})
    assert (tmp_path / "secrets" / "trainer").read_text() == password, "kept on a second call"
    (tmp_path / "o").mkdir()
    opened = make_credentials(tmp_path / "o", "r", locked=False)
    assert "nats_auth" not in opened.section("trainer", {}) and not (tmp_path / "o" / "secrets" / "admin").exists()


def test_a_prompt_issuer_key_in_the_users_environment_becomes_the_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`JETRL_TRAINER__TRUST__PROMPT_ISSUER_KEY` in the shell that runs `jetrl up`: the trainer checks
    pushed prompts with that key (not "set one, not both" beside up's own key file), and the run's
    key file, which `jetrl prompts push --run` finds, holds it."""
    from services.common.settings import deep_merge
    from services.up.credentials import ISSUER_KEY_ENV, adopt_issuer_key, make_credentials
    from services.up.stack import settings_class

    monkeypatch.delenv(ISSUER_KEY_ENV, raising=False)  # conftest's, for the other tests' trainers
    creds = make_credentials(tmp_path, "r")
    env = {ISSUER_KEY_ENV: "users-own-issuer-key", "HOME": "/h"}
    assert adopt_issuer_key(creds, env) == ISSUER_KEY_ENV
    assert env == {"HOME": "/h"}, "taken out of up's environment"
    key_file = tmp_path / "secrets" / "prompt-issuer-key"
    assert key_file.read_text().strip() == "users-own-issuer-key" and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    trainer = settings_class("trainer").model_validate(deep_merge({"feeder": {"dataset_path": "d.jsonl"}}, creds.section("trainer", {})))
    assert trainer.trust.prompt_issuer() == b"users-own-issuer-key"

    theirs = tmp_path / "their-key"
    theirs.write_text("from-a-file\n")
    env = {f"{ISSUER_KEY_ENV}_FILE": str(theirs)}
    assert adopt_issuer_key(creds, env) == f"{ISSUER_KEY_ENV}_FILE" and env == {}
    assert key_file.read_text().strip() == "from-a-file" and theirs.read_text() == "from-a-file\n", "their file only read"
    assert adopt_issuer_key(creds, {}) is None
