"""The end of a run: a summary, `metrics.json` and `reward_curve.png` in the run directory. Also used
by `jetrl plot` to redraw from the METRICS stream."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schemas import metric_names as names
from services.up.monitor import REWARD_KEYS, pick


def write_metrics(run_dir: Path, steps: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> Path:
    path = run_dir / "metrics.json"
    path.write_text(json.dumps({"steps": steps, **(extra or {})}, indent=1))
    return path


def outcome_text(outcomes: dict[str, float]) -> str:
    """The rollout workers' failures in a few words ("failed 12 (KeyError 9, TypeError 3) rejected 4
    shrunk 1"); empty when nothing went wrong."""
    failed = outcomes.get("episodes_failed_total", 0.0)
    rejected = outcomes.get("rejected_total", 0.0)
    shrunk = outcomes.get("groups_shrunk_total", 0.0)
    refused = outcomes.get("groups_not_accepted_total", 0.0)
    constraints = constraint_text(outcomes)
    if not (failed or rejected or shrunk or refused):
        return constraints
    kinds = sorted(((k.removeprefix("failed_by_"), n) for k, n in outcomes.items() if k.startswith("failed_by_") and n),
                   key=lambda kv: -kv[1])
    by = f" ({', '.join(f'{k} {n:.0f}' for k, n in kinds)})" if kinds else ""
    text = f"episodes failed {failed:.0f}{by} rejected {rejected:.0f} groups shrunk {shrunk:.0f}"
    return text + (f" not accepted {refused:.0f}" if refused else "") + (f" {constraints}" if constraints else "")


def constraint_text(counters: dict[str, float]) -> str:
    """Structured output's losses, when any: "constrained restarts 2 constraint unmet 1"."""
    restarts, unmet = (counters.get(k, 0.0) for k in (names.CONSTRAINED_RESTARTS_TOTAL, names.CONSTRAINT_UNMET_TOTAL))
    return f"constrained restarts {restarts:.0f} constraint unmet {unmet:.0f}" if restarts or unmet else ""


def workflow_stats_line(stats: list[dict[str, Any]], last: int = 10) -> str:
    """The workflow's own `stats_tracker` scalars for the summary: each one's mean over its last
    `last` reports, by its scoped name; "" when the workflow recorded none."""
    series: dict[str, list[float]] = {}
    for event in stats:
        for key, value in event.items():
            if "/" in key and isinstance(value, int | float):
                series.setdefault(key, []).append(float(value))
    if not series:
        return ""
    means = ", ".join(f"{k} {sum(v[-last:]) / len(v[-last:]):.3g}" for k, v in sorted(series.items()))
    return f"workflow statistics (mean of the last {last} reports): {means}"


def summary_lines(steps: list[dict[str, Any]], servers: dict[str, int], wall_s: float,
                  outcomes: dict[str, float] | None = None) -> list[str]:
    """`outcomes`: the rollout workers' failure counts (`RunView.episode_outcomes`), shown whenever
    something failed, and above all when no step was trained."""
    failures = outcome_text(outcomes or {})
    if not steps:
        return ["no trainer step was recorded", *([f"rollout: {failures}"] if failures else [])]
    first = [v for s in steps[:10] if (v := pick(s, REWARD_KEYS)) is not None]
    last = [v for s in steps[-10:] if (v := pick(s, REWARD_KEYS)) is not None]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    lines = [
        f"steps: {steps[-1]['step']}  final version: {steps[-1].get('version')}  wall: {wall_s:.0f} s",
        f"reward mean: first 10 steps {mean(first):.3f} -> last 10 steps {mean(last):.3f}",
    ]
    lines += startup_lines(steps)
    lines += waste_lines(steps)
    lines += publish_lines(steps)
    if failures:
        lines.append(f"rollout: {failures}")
    for server, version in sorted(servers.items()):
        lines.append(f"server {server}: weight version {version}")
    return lines


def startup_lines(steps: list[dict[str, Any]]) -> list[str]:
    """How long the stack took to get going: from `jetrl up`'s start (the bus, the model, every service's
    start-up, the first batch's generation) to the end of the first trainer step."""
    first = steps[0].get("time")
    return [] if first is None else [f"start-up: first step trained {first:.1f} s after the start"]


WASTED_KINDS = ("stale", "filtered", "duplicate")
"""Groups generated in full and not trained: judged stale, removed by dynamic filtering, or a repeat."""


def waste_lines(steps: list[dict[str, Any]]) -> list[str]:
    """Groups and samples generated for nothing, from the trainer's per-step counts (a group's samples
    taken as the step's samples per trained group), and the dataset rows the feeder gave up on."""
    trained = sum(s.get("groups", 0.0) for s in steps)
    wasted = {kind: sum(s.get(f"{kind}_groups", 0.0) for s in steps) for kind in WASTED_KINDS}
    samples = sum(
        sum(s.get(f"{kind}_groups", 0.0) for kind in WASTED_KINDS) * s["samples"] / s["groups"]
        for s in steps if s.get("groups")
    )
    share = f" ({100 * wasted['stale'] / trained:.1f}% of {trained:.0f} trained)" if trained else ""
    lines = [f"stale groups: {wasted['stale']:.0f}{share}  wasted samples: {samples:.0f} "
             f"({', '.join(f'{n:.0f} {kind}' for kind, n in wasted.items())} groups)"]
    last = steps[-1]
    if "feeder_dropped" in last:
        causes = [f"{k.removeprefix('feeder_dropped_')} {last[k]:.0f}" for k in sorted(last)
                  if k.startswith("feeder_dropped_") and last[k]]
        lines.append(f"dataset rows dropped: {last['feeder_dropped']:.0f}" + (f" ({', '.join(causes)})" if causes else "")
                     + f"  re-issued: {last.get('feeder_reissued', 0.0):.0f}")
    return lines


def publish_lines(steps: list[dict[str, Any]]) -> list[str]:
    """What publishing the weights cost the trainer: its share of all step time (gathering the
    weights plus waiting on the publish; `publish_share` per step), with the per-step medians."""
    timed = [s for s in steps if "publish_time_s" in s and s.get("step_time_s")]
    if not timed:
        return []
    gather = [s.get("weights_gather_s", 0.0) for s in timed]
    wait = [s["publish_time_s"] for s in timed]
    total = sum(s["step_time_s"] for s in timed)
    share = (sum(gather) + sum(wait)) / total if total > 0 else float("nan")
    return [f"publishing weights: {100 * share:.1f}% of step time (per step, median: gather {1e3 * _median(gather):.1f} ms, "
            f"publish {1e3 * _median(wait):.1f} ms, step {1e3 * _median([s['step_time_s'] for s in timed]):.0f} ms)"]


def _median(xs: list[float]) -> float:
    ordered = sorted(xs)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def last_error(log_path: Path) -> str:
    """The last error a service logged (its JSON log line), with its traceback as text: what a
    service died of, readable in the terminal rather than escaped inside a JSON line."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("level") in ("error", "critical"):
            head = f"{entry.get('event', '')}: {entry.get('error', '')}".strip(": ")
            return f"the error ({log_path.name}):\n{head}\n{entry.get('exception', '')}".rstrip()
    return ""
