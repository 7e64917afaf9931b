"""`jetrl up`'s services start with OpenMP's passive wait policy: the trainer's and the servers' torch
threads share the cores, and a waiting thread that spins takes a core from the process that computes.
A user who names OMP_WAIT_POLICY in `up.pass_env` keeps their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.up.launch import base_env
from services.up.settings import UpSettings


def test_every_service_gets_passive_waiters(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # not passed on unless named in pass_env
    env = base_env(UpSettings(), tmp_path)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["OMP_NUM_THREADS"] == "1"  # the trainer and the servers get their own count (compose.py)


def test_a_policy_passed_by_the_user_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    env = base_env(UpSettings(pass_env=["OMP_WAIT_POLICY"]), tmp_path)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"
