"""`jetrl prompts push`: push a JSONL/Parquet dataset onto the PROMPTS work queue, for rollout workers
running without a trainer's feeder (no admission rule: every row is published at once).

    jetrl prompts push data.jsonl --nats-url nats://127.0.0.1:4222 --run demo [--eval] [--limit N]

(`push` may be left out: `jetrl prompts data.jsonl ...` does the same.)
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from schemas.headers import prompt_headers
from schemas.messages import PromptTask, encode
from schemas.subjects import PROMPTS_STREAM, Subjects


async def push(nats_url: str, run: str, path: str, *, is_eval: bool = False, limit: int = 0, prefix: str = "push") -> int:
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
            await publish_acked(js, subject, encode(task), timeout_s=10.0, headers=prompt_headers(run, task.prompt_id),
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
        usage="jetrl prompts push DATASET [--nats-url URL] [--run RUN] [--eval] [--limit N] [--prefix P]",
        description=__doc__.split("\n\n")[0],
        epilog="`push` may be left out: `jetrl prompts DATASET ...` does the same.",
    )
    parser.add_argument("dataset", help="JSONL or Parquet file of rows ({\"prompt\", \"answer\", ...})")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--run", default="default")
    parser.add_argument("--eval", action="store_true", help="publish as eval prompts")
    parser.add_argument("--limit", type=int, default=0, help="only the first N rows (0: all)")
    parser.add_argument("--prefix", default="push", help="prompt ids are <prefix>-<row index> (de-duplicated by NATS)")
    ns = parser.parse_args(args)
    try:
        n = asyncio.run(push(ns.nats_url, ns.run, ns.dataset, is_eval=ns.eval, limit=ns.limit, prefix=ns.prefix))
    except (FileNotFoundError, ConnectionError, ValueError) as exc:  # no file, no server, a bad row
        print(f"jetrl prompts: {exc}", file=sys.stderr)
        return 1
    print(f"published {n} prompts to {Subjects(ns.run).prompts_eval if ns.eval else Subjects(ns.run).prompts_train}")
    return 0
