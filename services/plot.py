"""`jetrl plot RUN`: redraw a run's curves (reward, accuracy, staleness, trainer wait) from its
METRICS stream into `<run>/reward_curve.png` and `<run>/metrics.json`, and the workflow's own
`stats_tracker` scalars into `<run>/workflow_stats.png`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from nats.js.api import DeliverPolicy
from pydantic import ValidationError

from schemas.messages import MessageError, MetricsEvent, decode
from schemas.subjects import METRICS_STREAM, Subjects
from services.common.bus import Bus
from services.common.busretry import BusUnavailable
from services.common.nats_auth import NatsAuth
from services.common.streaminfo import leader_stream_info
from services.runs import run_auth, run_directory, run_nats
from services.up.curves import plot_curves, plot_workflow_stats
from services.up.monitor import RunView
from services.up.report import summary_lines, workflow_stats_line, write_metrics


async def read_metrics(url: str, run: str, auth: NatsAuth | None = None) -> RunView:
    """Every trainer step event of the run, from the start of the METRICS stream."""
    bus = Bus(url, auth)
    nc = await bus.connect("jetrl-plot", connect_timeout_s=10)
    js = nc.jetstream()
    view = RunView(started=0.0)
    info = await leader_stream_info(js, METRICS_STREAM, policy=bus.retry)  # a replica with no leader may be behind
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


def _auth(parser: argparse.ArgumentParser, pairs: list[str]) -> NatsAuth | None:
    """`--nats-auth KEY=VALUE` pairs as the `nats_auth` section every service has; a bad one is named."""
    if not pairs:
        return None
    fields: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or key not in NatsAuth.model_fields:
            parser.error(f"--nats-auth {pair!r}: expected KEY=VALUE with KEY one of {', '.join(NatsAuth.model_fields)}")
        fields[key] = value
    try:
        return NatsAuth.model_validate(fields)
    except ValidationError as exc:
        parser.error(f"--nats-auth: {exc.errors()[0]['msg']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jetrl plot", description=__doc__)
    parser.add_argument("run", help="run name (under --run-dir) or run directory")
    parser.add_argument("--run-dir", default="runs", help="where runs live (default runs/)")
    parser.add_argument("--nats-url", help="read from this NATS server instead of the run's own")
    parser.add_argument("--out", help="directory for the PNG and JSON (default: the run directory)")
    parser.add_argument("--nats-auth", action="append", default=[], metavar="KEY=VALUE",
                        help="a `nats_auth` setting for --nats-url, repeatable (e.g. user=observer, "
                             "password_file=F, creds_file=F, tls_ca_file=F; docs/security.md)")
    args = parser.parse_args(argv)
    auth = _auth(parser, args.nats_auth)
    path = run_directory(args.run, args.run_dir)
    if auth is None and not args.nats_url:  # a `jetrl up` run's own server: its observer user, if it made one
        auth = run_auth(path, "observer")
    try:
        with run_nats(path, args.nats_url) as url:
            view = asyncio.run(read_metrics(url, path.name, auth))
    except ConnectionRefusedError as exc:  # credentials or TLS: the server's own words, no traceback
        print(f"jetrl plot: {exc}; a secured bus needs --nats-auth (e.g. user=observer, password_file=F)", file=sys.stderr)
        return 1
    except BusUnavailable as exc:  # a cluster without a majority, a server that does not come back
        print(f"jetrl plot: the bus did not answer: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else path
    out.mkdir(parents=True, exist_ok=True)
    steps: list[dict[str, Any]] = view.steps
    write_metrics(out, steps, {"servers": view.servers, "evals": view.evals, "workflow_stats": view.workflow_stats})
    png = plot_curves(out, steps, f"jetrl run {path.name}", view.evals)
    wall = steps[-1]["time"] if steps else 0.0
    print("\n".join(summary_lines(steps, view.servers, wall)))
    if stats_text := workflow_stats_line(view.workflow_stats):
        print(stats_text)
    print(f"curve: {png}" if png else "no trainer steps in the METRICS stream")
    stats_png = plot_workflow_stats(out, view.workflow_stats, f"workflow statistics of run {path.name}")
    if stats_png:
        print(f"workflow statistics: {stats_png}")
    return 0 if steps else 1
