"""`jetrl plot RUN`: redraw a run's curves (reward, accuracy, staleness, trainer wait) from its
METRICS stream into `<run>/reward_curve.png` and `<run>/metrics.json`."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from nats.js.api import DeliverPolicy

from schemas.messages import MessageError, MetricsEvent, decode
from schemas.subjects import METRICS_STREAM, Subjects
from services.common.bus import connect
from services.runs import run_directory, run_nats
from services.up.curves import plot_curves
from services.up.monitor import RunView
from services.up.report import summary_lines, write_metrics


async def read_metrics(url: str, run: str) -> RunView:
    """Every trainer step event of the run, from the start of the METRICS stream."""
    nc = await connect(url, "jetrl-plot", connect_timeout_s=10)
    js = nc.jetstream()
    view = RunView(started=0.0)
    info = await js.stream_info(METRICS_STREAM)
    last = info.state.last_seq
    sub = await js.subscribe(Subjects(run).metrics_all, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL, stream=METRICS_STREAM)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=2.0)
            except Exception:  # no more messages within the timeout: the stream is read
                break
            try:
                event = decode(MetricsEvent, msg.data)
            except MessageError:
                view.malformed += 1
                continue
            if not view.steps and event.service == "trainer" and view.started == 0.0:
                view.started = event.time
            view.add(event)
            if msg.metadata.sequence.stream >= last:
                break
    finally:
        await nc.close()
    return view


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jetrl plot", description=__doc__)
    parser.add_argument("run", help="run name (under --run-dir) or run directory")
    parser.add_argument("--run-dir", default="runs", help="where runs live (default runs/)")
    parser.add_argument("--nats-url", help="read from this NATS server instead of the run's own")
    parser.add_argument("--out", help="directory for the PNG and JSON (default: the run directory)")
    args = parser.parse_args(argv)
    path = run_directory(args.run, args.run_dir)
    with run_nats(path, args.nats_url) as url:
        view = asyncio.run(read_metrics(url, path.name))
    out = Path(args.out) if args.out else path
    out.mkdir(parents=True, exist_ok=True)
    steps: list[dict[str, Any]] = view.steps
    write_metrics(out, steps, {"servers": view.servers, "evals": view.evals})
    png = plot_curves(out, steps, f"jetrl run {path.name}", view.evals)
    wall = steps[-1]["time"] if steps else 0.0
    print("\n".join(summary_lines(steps, view.servers, wall)))
    print(f"curve: {png}" if png else "no trainer steps in the METRICS stream")
    return 0 if steps else 1
