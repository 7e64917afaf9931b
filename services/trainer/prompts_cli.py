"""`jetrl prompts push`: push a JSONL/Parquet dataset onto the PROMPTS work queue, for rollout workers
running without a trainer's feeder (no admission rule: every row is published at once).

    jetrl prompts push data.jsonl --nats-url nats://127.0.0.1:4222 --run demo [--eval] [--limit N]
        [--issuer-key-file FILE]

(`push` may be left out: `jetrl prompts data.jsonl ...` does the same.)

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

from schemas.headers import prompt_headers
from schemas.messages import PromptTask, encode
from schemas.subjects import PROMPTS_STREAM, Subjects
from services.common.signing import prompt_tag

ISSUER_KEY_ENV = "JETRL_PROMPT_ISSUER_KEY"


async def push(nats_url: str, run: str, path: str, *, is_eval: bool = False, limit: int = 0, prefix: str = "push",
               issuer_key: bytes = b"") -> int:
    """`issuer_key`: tags each prompt (empty: untagged, and a trainer will not train its answers)."""
    from services.common.bus import connect, declare_streams, publish_acked
    from services.trainer.dataset import load_rows

    rows = load_rows(path)[: limit or None]
    subjects = Subjects(run)
    nc = await connect(nats_url, "jetrl-prompts")
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
        usage="jetrl prompts push DATASET [--nats-url URL] [--run RUN] [--eval] [--limit N] [--prefix P] [--issuer-key-file F]",
        description=__doc__.split("\n\n")[0],
        epilog="`push` may be left out: `jetrl prompts DATASET ...` does the same.",
    )
    parser.add_argument("dataset", help="JSONL or Parquet file of rows ({\"prompt\", \"answer\", ...})")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--run", default="default")
    parser.add_argument("--eval", action="store_true", help="publish as eval prompts")
    parser.add_argument("--limit", type=int, default=0, help="only the first N rows (0: all)")
    parser.add_argument("--prefix", default="push", help="prompt ids are <prefix>-<row index> (de-duplicated by NATS)")
    parser.add_argument("--issuer-key-file", default="",
                        help=f"file holding the trainer's trust.prompt_issuer_key (or set {ISSUER_KEY_ENV}); tags every prompt")
    ns = parser.parse_args(args)
    try:
        key = Path(ns.issuer_key_file).read_text().strip().encode() if ns.issuer_key_file else os.environ.get(ISSUER_KEY_ENV, "").encode()
        if not key:
            print(f"jetrl prompts: no issuer key (--issuer-key-file or {ISSUER_KEY_ENV}): a trainer will not train "
                  "answers to these prompts", file=sys.stderr)
        n = asyncio.run(push(ns.nats_url, ns.run, ns.dataset, is_eval=ns.eval, limit=ns.limit, prefix=ns.prefix, issuer_key=key))
    except (FileNotFoundError, ConnectionError, ValueError) as exc:  # no file, no server, a bad row
        print(f"jetrl prompts: {exc}", file=sys.stderr)
        return 1
    print(f"published {n} prompts to {Subjects(ns.run).prompts_eval if ns.eval else Subjects(ns.run).prompts_train}")
    return 0
