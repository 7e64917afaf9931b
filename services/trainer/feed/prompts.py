"""`jetrl prompts push`: push a JSONL/Parquet dataset onto the PROMPTS work queue, for rollout workers
running without a trainer's feeder (no admission rule: every row is published at once).

    jetrl prompts push data.jsonl --run demo [--run-dir runs] [--nats-url URL] [--eval] [--limit N]
        [--issuer-key-file FILE] [nats_auth.user=prompts nats_auth.password_file=F ... bus_declare=false]

(`push` may be left out: `jetrl prompts data.jsonl ...` does the same.)

On a live `jetrl up` run (no `--nats-url`: `<run-dir>/<run>/nats.url`) it connects as the run's
`prompts` user and tags with the run's prompt issuer key, both from `<run-dir>/<run>/secrets/`.

On a bus with per-service users (docs/security.md) it connects as the `prompts` user: the
`nats_auth.*` settings every service has, as key=value, and `bus_declare=false` (it then only looks the
streams up; `jetrl bus init` declared them).

A trainer trains only answers to prompts it issued or that carry a valid issuer tag: each prompt is
tagged with an HMAC over (run, prompt id) under the issuer key, the trainer's
`trust.prompt_issuer_key`, read from `--issuer-key-file` or the environment (`JETRL_PROMPT_ISSUER_KEY`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from nats.errors import TimeoutError as NatsTimeoutError

from schemas.headers import prompt_headers
from schemas.messages import PromptTask, encode
from schemas.subjects import PROMPTS_STREAM, Subjects
from services.common.nats_auth import NatsAuth
from services.common.signing import prompt_tag
from services.runs import PROMPT_ISSUER_KEY, SECRETS_DIR, live_url, run_bus

ISSUER_KEY_ENV = "JETRL_PROMPT_ISSUER_KEY"
DEFAULT_URL = "nats://127.0.0.1:4222"


async def push(nats_url: str, run: str, path: str, *, is_eval: bool = False, limit: int = 0, prefix: str = "push",
               issuer_key: bytes = b"", auth: NatsAuth | None = None, declare: bool = True) -> int:
    """`issuer_key`: tags each prompt (empty: untagged, and a trainer will not train its answers);
    `auth`: the NATS credentials; `declare`: False only looks the streams up (a restricted user)."""
    from services.common.bus import connect, declare_streams, publish_acked, set_default_declare
    from services.trainer.feed.dataset import load_rows

    rows = load_rows(path)[: limit or None]
    subjects = Subjects(run)
    set_default_declare(declare)
    nc = await connect(nats_url, "jetrl-prompts", connect_timeout_s=10.0, auth=auth)
    try:
        js = nc.jetstream()
        await declare_streams(js)
        subject = subjects.prompts_eval if is_eval else subjects.prompts_train
        for i, row in enumerate(rows):
            task = PromptTask(run=run, prompt_id=f"{prefix}-{i}", data=row, is_eval=is_eval)
            tag = prompt_tag(issuer_key, run, task.prompt_id) if issuer_key else ""
            await publish_acked(js, subject, encode(task), timeout_s=10.0, headers=prompt_headers(run, task.prompt_id, tag),
                                stream=PROMPTS_STREAM)
    finally:
        await nc.drain()
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) > 1 and args[0] == "push":  # the documented form; plain `jetrl prompts FILE` still works
        args = args[1:]
    parser = argparse.ArgumentParser(
        prog="jetrl prompts",
        usage="jetrl prompts push DATASET [--nats-url URL] [--run RUN] [--eval] [--limit N] [--prefix P]"
              " [--issuer-key-file F] [key=value ...]",
        description=__doc__.split("\n\n")[0],
        epilog="`push` may be left out: `jetrl prompts DATASET ...` does the same.",
    )
    parser.add_argument("dataset", help="JSONL or Parquet file of rows ({\"prompt\", \"answer\", ...})")
    parser.add_argument("--nats-url", default=None,
                        help="default: the live `jetrl up` run's own server (<run-dir>/<run>/nats.url, as the run's "
                             "`prompts` user with its prompt issuer key), else nats://127.0.0.1:4222")
    parser.add_argument("--run-dir", default="runs", help="where `jetrl up` keeps runs (default runs/)")
    parser.add_argument("--run", default="default")
    parser.add_argument("--eval", action="store_true", help="publish as eval prompts")
    parser.add_argument("--limit", type=int, default=0, help="only the first N rows (0: all)")
    parser.add_argument("--prefix", default="push", help="prompt ids are <prefix>-<row index> (de-duplicated by NATS)")
    parser.add_argument("--issuer-key-file", default="",
                        help=f"file holding the trainer's trust.prompt_issuer_key (or set {ISSUER_KEY_ENV}); tags every prompt")
    parser.add_argument("settings", nargs="*", metavar="key=value",
                        help="nats_auth.<field>=VALUE (user, password_file, token_file, creds_file, tls_ca_file, ...) "
                             "and bus_declare=false, as every service takes them")
    ns = parser.parse_intermixed_args(args)
    try:
        auth, declare = _bus_settings(ns.settings)
        run_path = Path(ns.run_dir) / ns.run
        url, run_user = run_bus(run_path, "prompts", ns.nats_url or DEFAULT_URL,
                                {"nats_url"} if ns.nats_url else ({"nats_auth"} if auth else set()))
        if run_user is not None:  # a `jetrl up` run's own bus: its `prompts` user; `up` declared the streams
            auth, declare = run_user, False
        issuer = run_path / SECRETS_DIR / PROMPT_ISSUER_KEY
        if ns.issuer_key_file:
            key = Path(ns.issuer_key_file).read_text().strip().encode()
        elif os.environ.get(ISSUER_KEY_ENV):
            key = os.environ[ISSUER_KEY_ENV].encode()
        else:  # the run's own key, when pushing to the run's own server
            key = issuer.read_text().strip().encode() if not ns.nats_url and live_url(run_path) and issuer.is_file() else b""
        if not key:
            print(f"jetrl prompts: no issuer key (--issuer-key-file or {ISSUER_KEY_ENV}): a trainer will not train "
                  "answers to these prompts", file=sys.stderr)
        n = asyncio.run(push(url, ns.run, ns.dataset, is_eval=ns.eval, limit=ns.limit, prefix=ns.prefix, issuer_key=key,
                             auth=auth, declare=declare))
    except (FileNotFoundError, ConnectionError, ValueError) as exc:  # no file, no server, a bad row
        print(f"jetrl prompts: {exc}", file=sys.stderr)
        return 1
    except NatsTimeoutError:  # a refused publish is never acknowledged: the server logs why
        print(f"jetrl prompts: the server did not acknowledge the prompts of run {ns.run!r}: a user without permission "
              "to publish them is refused (see the 'nats error' line above and the nats-server log); "
              "run as the `prompts` user (docs/security.md)", file=sys.stderr)
        return 1
    print(f"published {n} prompts to {Subjects(ns.run).prompts_eval if ns.eval else Subjects(ns.run).prompts_train}")
    return 0


def _bus_settings(pairs: list[str]) -> tuple[NatsAuth | None, bool]:
    """`nats_auth.<field>=V` and `bus_declare=true|false` into (credentials, declare); anything else
    is an error naming it."""
    fields: dict[str, str] = {}
    declare = True
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"{pair!r}: expected key=value")
        if key == "bus_declare":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"bus_declare={value!r}: expected true or false")
            declare = value.lower() in ("true", "1")
        elif key.startswith("nats_auth.") and key.removeprefix("nats_auth.") in NatsAuth.model_fields:
            fields[key.removeprefix("nats_auth.")] = value
        else:
            raise ValueError(f"{key!r}: not a setting of jetrl prompts (nats_auth.<field>, bus_declare)")
    return (NatsAuth.model_validate(fields) if fields else None), declare
