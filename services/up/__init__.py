"""`jetrl up`: the whole pipeline on this machine - an embedded nats-server, the tiny model, an
inference server with its weights agent, the reward service, rollout workers and the trainer, each
its own process configured by environment variables - supervised until the trainer finishes."""

from __future__ import annotations

import sys
from typing import Any

from services.common.settings import SettingsError, load_settings, read_yaml

SERVICE_SECTIONS = ("inference", "rollout", "reward", "trainer", "weights", "track")


def main(argv: list[str] | None = None) -> int:
    from services.common.entry import read_command_line
    from services.up.settings import UpSettings

    line = read_command_line(
        UpSettings, argv, "jetrl up", __doc__ or "",
        config_help="YAML with an `up:` section and one section per service",
        epilog="--config FILE may also hold one section per service (inference, rollout, reward, trainer,"
        " weights, track) with that service's settings (see `jetrl <service> --help`).",
    )
    from services.up.launch import run_stack, validate_sections

    try:  # a bad --config (missing, not YAML, unknown section or key) is a message and exit 2
        data = read_yaml(line.config) if line.config else {}
        sections = _service_sections(line.config, data)
        settings = load_settings(UpSettings, overrides=line.overrides, values=data.get("up") or {})
        validate_sections(sections, settings.dataset_path, settings.stop_at_eval_lift)
    except SettingsError as exc:
        print(f"jetrl up: {exc}", file=sys.stderr)
        return 2
    return run_stack(settings, sections)


def _service_sections(config: str | None, data: dict[str, Any]) -> dict[str, dict]:
    """The file's service sections (`jetrl up`'s own is `up:`); an unknown section is an error."""
    unknown = set(data) - set(SERVICE_SECTIONS) - {"up"}
    if unknown:
        raise SettingsError(
            f"--config {config}: unknown top-level section(s) {sorted(unknown)}; expected up, {', '.join(SERVICE_SECTIONS)}"
        )
    return {k: v or {} for k, v in data.items() if k in SERVICE_SECTIONS}
