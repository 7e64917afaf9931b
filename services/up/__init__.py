"""`jetrl up`: the whole pipeline on this machine - an embedded nats-server, the tiny model, an
inference server with its weights agent, the reward service, rollout workers and the trainer, each
its own process configured by environment variables - supervised until the trainer finishes."""

from __future__ import annotations

import argparse
import os
import sys

from services.common.entry import settings_help
from services.common.settings import SettingsError, load_settings, read_yaml

SERVICE_SECTIONS = ("inference", "rollout", "reward", "trainer", "weights", "track")


def main(argv: list[str] | None = None) -> int:
    from services.up.settings import UpSettings

    parser = argparse.ArgumentParser(
        prog="jetrl up",
        description=__doc__,
        epilog=settings_help(UpSettings)
        + "\n\n--config FILE may also hold one section per service (inference, rollout, reward, trainer,"
        " weights) with that service's settings (see `jetrl <service> --help`).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML with an `up:` section and one section per service")
    parser.add_argument("--rollout-workers", type=int, help="rollout worker processes (default 2)")
    parser.add_argument("--steps", type=int, help="trainer steps at most (default: the total_steps setting)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="`jetrl up` settings, e.g. run=exp1")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.rollout_workers is not None:
        overrides.append(f"rollout_workers={args.rollout_workers}")
    if args.steps is not None:
        overrides.append(f"total_steps={args.steps}")
    from services.up.run import run_stack, validate_sections

    up_config = None
    try:  # a bad --config (missing, not YAML, unknown section or key) is a message and exit 2
        up_config = _up_only(args.config)
        sections = _service_sections(args.config)
        validate_sections(sections)
        settings = load_settings(UpSettings, up_config, overrides)
    except SettingsError as exc:
        print(f"jetrl up: {exc}", file=sys.stderr)
        return 2
    finally:
        if up_config:
            os.unlink(up_config)
    return run_stack(settings, sections)


def _service_sections(config: str | None) -> dict[str, dict]:
    if not config:
        return {}
    data = read_yaml(config)  # the whole file
    unknown = set(data) - set(SERVICE_SECTIONS) - {"up"}
    if unknown:
        raise SettingsError(
            f"--config {config}: unknown top-level section(s) {sorted(unknown)}; expected up, {', '.join(SERVICE_SECTIONS)}"
        )
    return {k: v or {} for k, v in data.items() if k in SERVICE_SECTIONS}


def _up_only(config: str | None) -> str | None:
    """`jetrl up`'s own section, written where load_settings can read it."""
    if not config:
        return None
    import tempfile

    import yaml

    data = read_yaml(config)
    f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    yaml.safe_dump(data.get("up") or {}, f)
    f.close()
    return f.name
