"""`jetrl --help` and `jetrl <service> --help` list commands and settings with their docs, fast."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from schemas.messages import PromptTask, decode
from schemas.subjects import PROMPTS_STREAM
from services.cli import COMMANDS


def jetrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=60)


def test_top_level_help_lists_every_command() -> None:
    out = jetrl("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


def test_every_listed_command_answers_help() -> None:
    """Each command `jetrl --help` lists prints its help and exits 0 (a "%" in a setting's docstring
    once crashed `jetrl up --help` inside argparse's %-formatting)."""
    listed = jetrl("--help").stdout.split("commands:\n", 1)[1].split("\n\n", 1)[0]
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    assert names == list(COMMANDS)
    for name in names:
        out = jetrl(name, "--help")
        assert out.returncode == 0, f"jetrl {name} --help: {out.stderr[-800:]}"
        assert f"jetrl {name}" in out.stdout or "usage" in out.stdout, out.stdout[:300]


def test_unknown_command_is_an_error() -> None:
    out = jetrl("nope")
    assert out.returncode == 2
    assert "unknown command 'nope'" in out.stderr


def _available(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError:
        return False
    return True


SERVICES = [
    n
    for n in ("inference", "rollout", "reward", "trainer", "weights")
    if _available(f"services.{n}") and hasattr(importlib.import_module(f"services.{n}"), "main")
]


@pytest.mark.parametrize("name", SERVICES)
def test_service_help_lists_settings_with_docs(name: str) -> None:
    out = jetrl(name, "--help")
    assert out.returncode == 0, out.stderr
    assert "nats_url" in out.stdout and "NATS server URL" in out.stdout
    assert f"JETRL_{name.upper()}__" in out.stdout
    # --help must not pay for torch: settings are validated before heavy imports
    probe = (
        "import sys\nfrom services.cli import main\n"
        f"try:\n    main([{name!r}, '--help'])\nexcept SystemExit:\n    pass\n"
        "print('HEAVY' if 'torch' in sys.modules else 'LIGHT')"
    )
    light = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert light.stdout.strip().endswith("LIGHT"), light.stdout[-300:]


def test_bad_setting_exits_2_naming_it() -> None:
    if not SERVICES:
        pytest.skip("no service package yet")
    out = jetrl(SERVICES[0], "no_such_key=1")
    assert out.returncode == 2
    assert "no_such_key: unknown key" in out.stderr


def test_prompts_push_as_documented_and_the_short_form_both_fill_the_work_queue(nats_url: str, tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{i:03d}=", "answer": "{i:03d}"}}\n' for i in range(3)))
    helped = jetrl("prompts", "--help")
    assert helped.returncode == 0 and "jetrl prompts push DATASET" in helped.stdout
    assert "prompts push FILE" in jetrl("--help").stdout
    pushed = jetrl("prompts", "push", str(data), "--nats-url", nats_url, "--run", "cli")  # docs/design.md's spelling
    assert pushed.returncode == 0, pushed.stderr
    assert "published 3 prompts to jetrl.cli.prompts.train" in pushed.stdout
    short = jetrl("prompts", str(data), "--nats-url", nats_url, "--run", "cli", "--prefix", "old", "--limit", "2")
    assert short.returncode == 0, short.stderr
    missing = jetrl("prompts", "push", str(tmp_path / "nope.jsonl"), "--nats-url", nats_url)
    assert missing.returncode == 1 and "nope.jsonl does not exist" in missing.stderr and "Traceback" not in missing.stderr

    async def queued() -> list[tuple[str, str]]:
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        n = (await js.stream_info(PROMPTS_STREAM)).state.messages
        got = [await js.get_msg(PROMPTS_STREAM, seq) for seq in range(1, n + 1)]
        await nc.close()
        return [((m.headers or {})["Nats-Msg-Id"], decode(PromptTask, m.data or b"").data["prompt"]) for m in got]

    assert asyncio.run(queued()) == [
        ("cli/prompt/push-0", "000="), ("cli/prompt/push-1", "001="), ("cli/prompt/push-2", "002="),
        ("cli/prompt/old-0", "000="), ("cli/prompt/old-1", "001="),
    ]
