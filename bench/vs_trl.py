"""jetrl against TRL's GRPOTrainer on the same machine, model, prompts, reward and settings, each at its best.

Both sides run every setting of a sweep (prompts per step `--batches`, learning rate `--lrs`; jetrl also
its staleness budget `--etas`), `--seeds` seeds each, one run at a time, each in its own process, seeds
interleaved (the first seed of every setting on both sides, then the next, ...) so a change in the machine's load
falls on both. A setting's figure is its median over seeds (a run that never reaches the target counts
as infinitely slow); each side's best setting is compared with the other's best:
`score` = TRL's best median time / jetrl's best median time, >= 1.0 when jetrl is no slower.

--task copy3 (default): the demo's task on the tiny model (`jetrl make-model`); time from the command's
start (imports, model load, the stack's start-up count) until the 10-step mean reward reaches
`--target`. jetrl runs with the demo's preset (services/up/presets.py) and the sweep's values over it.

--task arith: SmolLM2-135M-Instruct (`jetrl make-model smollm2-135m-instruct`) learns the arithmetic
task (`task:arith`: the same training and eval rows both sides, the reward numeric_match, the model's
chat template), LoRA on both sides, examples/smollm2_arith.yaml's settings; time until the eval pass
rate is `--lift` over the run's own step-0 pass rate (TRL's eval time is taken off its clock).

For jetrl's best setting the bench prints where its time to the target went (start-up until the first
step, waiting for data, training, publishing, gaps between steps) beside TRL's (start-up, generation and
scoring, training), CPU-seconds and peak resident size per process, and the most that CPU per sample
allows against TRL's best run on these cores (bench/support/vs_trl_ceiling.py: TRL's steps, every core
busy all the time).

    python bench/vs_trl.py                                  # copy3, 3 seeds, 16 and 32 prompts a step
    python bench/vs_trl.py --seeds 1 --batches 32           # a quick run
    python bench/vs_trl.py --task arith --seeds 1 --batches 4 --max-steps 60   # the real model

TRL comes from the optional extra `.[peer]` (`pip install "trl>=1.16"`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, get_args

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.support import vs_trl_report as report  # noqa: E402  (after the sys.path line)
from bench.support.jetrl_side import arith_sections, copy3_sections, cpu_since, run_up, step_split  # noqa: E402
from services.up.presets import DEMO_PRESET  # noqa: E402
from services.up.settings import BesideTrainer  # noqa: E402

GROUP = DEMO_PRESET["rollout"]["group_size"]
CLIP = 0.2


def make_inputs(task: str, work: Path) -> tuple[Path, Path, Path | None]:
    """The model, the training rows and (arith) the eval rows: the files both sides read."""
    if task == "copy3":
        from services.common.demo_task import write_copy3_dataset
        from services.inference.make_model import build_model

        return build_model(work / "model"), write_copy3_dataset(work / "copy3.jsonl", 4096, 0), None
    from services.common.arith_task import write_task
    from services.common.model_path import resolve_model_path

    train, held_out = write_task("arith", work / "data", 4096)  # what `jetrl up dataset_path=task:arith` writes
    return Path(resolve_model_path("smollm2-135m-instruct")), train, held_out


def trl_spec(task: str, setting: dict[str, Any], seed: int, inputs: tuple[Path, Path, Path | None], args: argparse.Namespace,
             shape: dict[str, Any], out: Path) -> dict[str, Any]:
    """What the TRL peer process runs: the shape both sides share, then this run's own setting over it
    (the swept precision and threads are TRL's; the shape's "dtype" and "threads" describe jetrl's)."""
    model, dataset, eval_set = inputs
    spec = {**shape, "task": task, "model": str(model), "dataset": str(dataset), "eval": str(eval_set) if eval_set else None,
            "seed": seed, "out": str(out), "batch": setting["batch"], "lr": setting["lr"], "dtype": setting.get("dtype", "float32"),
            "clip": CLIP, "threads": setting["threads"]}
    if task == "copy3":
        spec.update(steps=args.steps, target=args.target)
    else:
        spec.update(steps=args.max_steps, lift=args.lift, eval_every=args.eval_every, eval_size=args.eval_size)
    return spec


def run_trl(task: str, setting: dict[str, Any], seed: int, inputs: tuple[Path, Path, Path | None], args: argparse.Namespace,
            shape: dict[str, Any], work: Path) -> dict[str, Any]:
    out = work / f"trl-{report.label(setting)}-{seed}.json"
    spec = trl_spec(task, setting, seed, inputs, args, shape, out)
    spec_path = work / f"trl-{report.label(setting)}-{seed}.spec.json"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    spec["launched"] = launched = time.time()
    spec_path.write_text(json.dumps(spec))
    threads = str(setting["threads"])
    log_path = work / f"trl-{report.label(setting)}-{seed}.log"
    with log_path.open("w") as log_file:  # its progress lines ("trl ...") shown as they come; everything kept in the log
        proc = subprocess.Popen([sys.executable, "-m", "bench.support.trl_peer", str(spec_path)], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=log_file,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
        assert proc.stdout is not None
        for line in proc.stdout:
            log_file.write(line)
            if line.startswith("trl "):
                print(f"    {line.rstrip()}", flush=True)
        returncode = proc.wait()
    wall, cpu = time.time() - launched, cpu_since(before)
    if returncode != 0:
        raise RuntimeError(f"TRL {report.label(setting)} seed {seed} failed (log: {log_path}):\n{log_path.read_text()[-3000:]}")
    got = json.loads(out.read_text())
    steps = [s for s in got["steps"] if "reward" in s]
    first = steps[0]["t"] - steps[0]["step_s"] if steps else None
    run = {"side": "trl", "setting": setting, "seed": seed, "wall_s": wall, "cpu_s": cpu, "steps": len(steps),
           "samples": len(steps) * setting["batch"] * shape["group"], "startup_s": first, "peak_rss_gib": {"trl": got["peak_rss_gib"]},
           "history": steps, "evals": got["evals"], "eval_s": got["eval_s"]}
    return run | report.outcome(task, [(s["step"], s["reward"], s["t"]) for s in steps], got["evals"], args)


def run_name(task: str, setting: dict[str, Any], seed: int) -> str:
    """The `jetrl up` run name of a setting's run: a NATS subject token, so the label's spaces, dots and
    other signs (':' and '+' of `--beside`) become characters `jetrl up` takes."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"vs-trl-{task}-{report.label(setting)}-{seed}".replace(" ", "-").replace(".", "p"))


def run_jetrl(task: str, setting: dict[str, Any], seed: int, inputs: tuple[Path, Path, Path | None], args: argparse.Namespace,
              shape: dict[str, Any], work: Path) -> dict[str, Any]:
    model, dataset, _ = inputs
    name = run_name(task, setting, seed)
    if task == "copy3":
        sections = copy3_sections(DEMO_PRESET, setting, seed)
        extra = [f"model_path={model}", f"dataset_path={dataset}", f"total_steps={args.steps}", f"stop_at_reward={args.target}"]
    else:  # the task generated by jetrl up itself (the same rows as `inputs`, written by the same function)
        sections = arith_sections(setting, seed, args.max_steps)
        sections["trainer"]["feeder"].update(eval_every=args.eval_every, eval_size=args.eval_size)
        extra = [f"stop_at_eval_lift={args.lift}"]  # ends at the round that lifts, as TRL's run does
    try:
        metrics, measured = run_up(name, sections, work, extra)
    except RuntimeError as exc:  # e.g. a server's port taken before it bound it: the sweep goes on, the retry is printed
        print(f"    jetrl {name} failed to run ({str(exc).splitlines()[0][:200]}); running it again", flush=True)
        metrics, measured = run_up(name + "-again", sections, work, extra)
    tree = measured["tree"]
    offset = measured["offset"]
    history = [s | {"t": s["time"] + offset} for s in metrics["steps"]]
    evals = [e | {"t": e["time"] + offset} for e in metrics.get("evals", [])]
    last = history[-1] if history else {}
    generated = sum(last.get(f"total_{k}", 0.0) for k in ("accepted", "stale", "filtered", "duplicate", "malformed")) * shape["group"]
    first = history[0]["t"] - history[0].get("step_time_s", 0.0) if history else None  # until the first step began
    run = {"side": "jetrl", "setting": setting, "seed": seed, "wall_s": measured["wall_s"], "cpu_s": measured["cpu_s"],
           "steps": len(history), "samples": generated, "stale_groups": last.get("total_stale", 0.0), "startup_s": first,
           "outcome": metrics.get("outcome"), "history": history, "evals": evals,
           "cpu_startup": tree.by_label(until_s=history[0]["t"]) if history else {}, "cpu_total": tree.by_label(),
           "peak_rss_gib": tree.peak_rss_by_label()}
    out = run | report.outcome(task, [(s["step"], s["reward_mean"], s["t"]) for s in history], evals, args)
    out["split"] = step_split(history, out["step_target"])
    return out


def _nonnegative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a seed is 0 or more, got {value}")
    return value


BESIDE: tuple[str, ...] = get_args(BesideTrainer)


def _beside(parser: argparse.ArgumentParser, value: str) -> list[str]:
    """One `--beside` value: "none" or service names joined by "+"."""
    names = [] if value == "none" else value.split("+")
    bad = [n for n in names if n not in BESIDE]
    if bad:
        parser.error(f"--beside: {', '.join(bad)} is not one of none, {', '.join(BESIDE)} (joined by '+'); got {value!r}")
    return names


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("copy3", "arith"), default="copy3")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=_nonnegative, default=0,
                        help="the first seed (runs seeds first..first+seeds-1): more seeds for an earlier run's settings")
    parser.add_argument("--batches", default=None, help="prompts per step, both sides (copy3: 16,32; arith: 2,4)")
    parser.add_argument("--lrs", default=None, help="learning rates, both sides (copy3: 1e-3; arith: 3e-4, the example's)")
    parser.add_argument("--trl-dtypes", default=None,
                        help="TRL's precisions, swept (copy3: float32; arith: float32,bfloat16: bf16 mixed precision, as jetrl's "
                             "example trains in bf16)")
    parser.add_argument("--trl-threads", default=None,
                        help="TRL's torch threads, swept (default: the cores this process may use, torch's own default; the "
                             "caller's OMP_NUM_THREADS is not inherited: ./dev sets 1, which would hold TRL to one core)")
    parser.add_argument("--etas", default="2", help="jetrl's staleness budgets (the presets': 2)")
    parser.add_argument("--pins", default="on", help="jetrl's up.pin_trainer, swept: on (its default), off or on,off (the "
                        "trainer on a core of its own, every other service on the rest)")
    parser.add_argument("--beside", default="", help="jetrl's up.beside_trainer, swept: the services on the pinned trainer's "
                        "cores, each value 'none' or names joined by '+' (reward+weights,none); default: up's own")
    parser.add_argument("--steps", type=int, default=500, help="copy3: step budget of every run (the demo's)")
    parser.add_argument("--target", type=float, default=0.9, help="copy3: 10-step mean reward to reach")
    parser.add_argument("--max-steps", type=int, default=120, help="arith: step budget of every run")
    parser.add_argument("--lift", type=float, default=0.10, help="arith: eval pass rate to gain over step 0")
    parser.add_argument("--eval-every", type=int, default=10, help="arith: steps between eval rounds")
    parser.add_argument("--eval-size", type=int, default=32, help="arith: eval prompts a round (the first N of the eval set)")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-jetrl", action="store_true")
    args = parser.parse_args()
    copy3 = args.task == "copy3"
    args.batches = [int(b) for b in (args.batches or ("16,32" if copy3 else "2,4")).split(",") if b.strip()]
    args.lrs = [float(x) for x in (args.lrs or ("1e-3" if copy3 else "3e-4")).split(",") if x.strip()]
    args.trl_dtypes = [d for d in (args.trl_dtypes or ("float32" if copy3 else "float32,bfloat16")).split(",") if d.strip()]
    args.etas = [int(e) for e in args.etas.split(",") if e.strip()] or [2]  # "": the presets' eta
    pins = {"off": False, "on": True}
    bad = [p for p in args.pins.split(",") if p.strip() not in pins]
    if bad:
        parser.error(f"--pins takes on, off or on,off; got {args.pins!r}")
    args.pins = [pins[p.strip()] for p in args.pins.split(",")]
    args.beside = [_beside(parser, b.strip()) for b in args.beside.split(",") if b.strip()]
    args.trl_threads = [int(t) for t in (args.trl_threads or str(len(os.sched_getaffinity(0)))).split(",") if t.strip()]
    return args


def main() -> None:
    args = parse()
    shape = report.shape(args.task)
    report.print_mapping(args, shape)
    work = Path(tempfile.mkdtemp(prefix=f"jetrl-vs-trl-{args.task}-"))
    print(f"work directory (the runs' files, kept): {work}", flush=True)
    inputs = make_inputs(args.task, work)
    trl_settings = [{"batch": b, "lr": lr, **({"dtype": d} if args.trl_dtypes != ["float32"] else {}), "threads": t}
                    for b in args.batches for lr in args.lrs for d in args.trl_dtypes for t in args.trl_threads]
    jetrl_settings = [{"batch": b, "eta": e, "lr": lr, "pin": pin, **({"beside": bs} if bs is not None else {})}
                      for b in args.batches for e in args.etas for lr in args.lrs for pin in args.pins
                      for bs in (args.beside or [None])]
    runs: list[dict[str, Any]] = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for b in args.batches:
            if not args.skip_trl:
                for s in (s for s in trl_settings if s["batch"] == b):
                    runs.append(run_trl(args.task, s, seed, inputs, args, shape, work))
                    report.print_progress(runs[-1])
            if not args.skip_jetrl:
                for s in (s for s in jetrl_settings if s["batch"] == b):
                    runs.append(run_jetrl(args.task, s, seed, inputs, args, shape, work))
                    report.print_progress(runs[-1])
    figures = report.summarize(args, runs)
    print(json.dumps(report.finite(figures)))


if __name__ == "__main__":
    main()
