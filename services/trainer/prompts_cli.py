"""`jetrl prompts`: push a JSONL/Parquet dataset onto the PROMPTS work queue, for rollout workers
running without a trainer's feeder (no admission rule: every row is published at once).

    jetrl prompts --nats-url nats://127.0.0.1:4222 --run demo data.jsonl [--eval] [--limit N]
"""

from __future__ import annotations

import argparse
import asyncio

from schemas.messages import PromptTask, encode
from schemas.subjects import HDR_MSG_ID, PROMPTS_STREAM, Subjects


async def push(nats_url: str, run: str, path: str, *, is_eval: bool = False, limit: int = 0, prefix: str = "push") -> int:
    from services.common.bus import connect, declare_streams
    from services.trainer.feeder import load_rows

    rows = load_rows(path)[: limit or None]
    subjects = Subjects(run)
    nc = await connect(nats_url, "jetrl-prompts")
    try:
        js = nc.jetstream()
        await declare_streams(js)
        subject = subjects.prompts_eval if is_eval else subjects.prompts_train
        for i, row in enumerate(rows):
            task = PromptTask(run=run, prompt_id=f"{prefix}-{i}", data=row, is_eval=is_eval)
            await js.publish(subject, encode(task), headers={HDR_MSG_ID: f"{run}/prompt/{task.prompt_id}"}, stream=PROMPTS_STREAM)
    finally:
        await nc.drain()
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jetrl prompts", description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", help="JSONL or Parquet file of rows ({\"prompt\", \"answer\", ...})")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--run", default="default")
    parser.add_argument("--eval", action="store_true", help="publish as eval prompts")
    parser.add_argument("--limit", type=int, default=0, help="only the first N rows (0: all)")
    parser.add_argument("--prefix", default="push", help="prompt ids are <prefix>-<row index> (de-duplicated by NATS)")
    args = parser.parse_args(argv)
    n = asyncio.run(push(args.nats_url, args.run, args.dataset, is_eval=args.eval, limit=args.limit, prefix=args.prefix))
    print(f"published {n} prompts to {Subjects(args.run).prompts_eval if args.eval else Subjects(args.run).prompts_train}")
    return 0
