"""Peak memory and tokens/s of one trainer update on a Qwen2-0.5B-shaped model (random weights, built
locally from a config), the real-model path against today's, in the same run:

- today: ZeRO-2 (the trainer's default until `zero_stage: auto`), one forward/backward per mini-batch
  piece, log-probs and entropy over the whole float32 (tokens x vocabulary) log-softmax, no gradient
  checkpointing;
- new: no ZeRO (what `auto` picks on one rank), `max_tokens_per_microbatch` (`--budget`),
  `pack_sequences`, `logp_chunk_tokens`, and `gradient_checkpointing`, with the output projection
  fused into the chunked log-prob function (`fused_output_projection` and `fused_keep_probs_mb` at
  their defaults);
- with `--paths`: today-z0 (today's path without ZeRO: the stage's share alone), new-z2 (the new path
  on ZeRO-2), unfused (the new path with `fused_output_projection=false`: the fusion's share).

    python bench/trainer_memory.py [--layers 24] [--samples 8] [--seq-len 4096] [--steps 2] [--lengths uniform] [--budget N]
                                   [--paths today,new,...] [--trace today,...]

`--budget` is the new path's `max_tokens_per_microbatch` (default `--seq-len`): a larger one packs
several samples per pass (fewer passes, larger logits).

`--lengths varied` gives the samples lengths spread evenly from a quarter of `--seq-len` to all of it
(as generations of different lengths are): today's path pads them to the longest, the packed one
computes only their tokens. tokens/s counts real tokens either way.

Defaults are the full shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab
151936) on 8 samples of 4k tokens: today's path alone needs well over 100 GB there (the logits and
the log-softmax are 20 GB each), so a small machine runs today's path there as a trace:
`--trace today` runs its code on fake tensors (bench/support/tracemem.py: every storage it allocates is counted
while it lives, nothing is computed) and reports its peak of live tensor bytes plus the process's
resident size; traced rows have no time. A path both run and traced prints the trace's error against
the run. The score takes today's run where it ran, else its trace (`today_from` in the JSON).

Each path runs in its own process (DeepSpeed at the path's stage, one CPU rank, the trainer's TrainEngine and
PPOActor with the default decoupled PPO update, so the proximal forward is included). Peak memory is
the process's resident high-water mark (VmHWM, reset before the last update; ru_maxrss where /proc has
no reset) over the last update, model and Adam states included ("added": that peak minus the resident
size before the update, i.e. what the update itself needs); tokens/s is over the last update (the
first allocates the optimizer states), and so is tokens per CPU-second (the process's CPU time: on a
shared machine wall-clock tokens/s follows the load, CPU time much less). A thread samples the resident size every 5 ms and keeps its peak
per phase of the update (proximal forward, forward, log-probs and loss, backward, ZeRO's gradient
reduction at the end of each backward, optimizer step). Prints the tables, then a JSON line whose
`score` is new peak / today's peak (target <= 0.4 with tokens/s no more than 10% lower).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

REAL = {"logp_chunk_tokens": 1024, "gradient_checkpointing": True, "pack_sequences": True}
PATHS: dict[str, dict[str, Any]] = {
    "today": {"zero_stage": 2},
    # today's path without ZeRO: what the stage alone changes
    "today-z0": {"zero_stage": 0},
    # + max_tokens_per_microbatch = --budget; fused_output_projection and fused_keep_probs_mb at their defaults
    "new": {"zero_stage": 0, **REAL},
    # the new path on ZeRO-2: what the log-prob path, micro-batches and checkpointing change alone
    "new-z2": {"zero_stage": 2, **REAL},
    # the new path with the log-probs from the model's logits: what the fused output projection changes
    "unfused": {"zero_stage": 0, **REAL, "fused_output_projection": False},
}
DEFAULT_PATHS = "today,today-z0,new,new-z2"


def build(out: Path, layers: int, vocab: int) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=896, num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
                      intermediate_size=4864, vocab_size=vocab, max_position_embeddings=32768, tie_word_embeddings=True,
                      rms_norm_eps=1e-6)  # rope base left at the default: it changes no memory or time
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return str(out)


def batch(samples: int, seq_len: int, vocab: int, lengths: str) -> dict:
    """One group of `samples` rows of up to `seq_len` tokens (all of it, or spread from a quarter of
    it with `lengths` varied): a prompt of a quarter of `seq_len`, the rest generated."""
    import numpy as np

    from services.trainer.intake.batch import collate
    from services.trainer.model.ppo import attach_advantages

    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, size=(samples, seq_len))
    sizes = np.full(samples, seq_len) if lengths == "uniform" else np.linspace(seq_len // 4 + 1, seq_len, samples).astype(int)
    am = (np.arange(seq_len)[None, :] < sizes[:, None]).astype(np.int64)
    lm = np.zeros_like(ids)
    lm[:, seq_len // 4 :] = 1
    lm *= am
    group: dict[str, np.ndarray] = {"input_ids": ids * am, "attention_mask": am, "loss_mask": lm,
             "logprobs": (-2.3 * lm).astype(np.float32), "versions": np.where(lm > 0, 0, -1),
             "rewards": rng.random(samples).astype(np.float32)}
    return attach_advantages(collate([group]), "grpo", 1e-6)


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _peak_bytes(reset: bool) -> int:
    if reset:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


PHASES = ("proximal", "forward", "logp+loss", "backward", "zero-reduce", "step")


class PhasePeaks:
    """The maximum of a size per phase of the update (the innermost running one of `PHASES`, the
    proximal pass's forward counted as "proximal"): where the peak is, not only how high. The size is
    the resident size sampled every few ms on a thread, or with `sampled=False` what `record` is given
    (a traced run's live tensor bytes, at each allocation)."""

    def __init__(self, sampled: bool = True) -> None:
        import threading

        self.phase = "other"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True) if sampled else None
        if self._thread is not None:
            self._thread.start()

    def record(self, size: int) -> None:
        phase = self.phase
        self.peaks[phase] = max(self.peaks.get(phase, 0), size)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.record(_rss_bytes())

    def wrap(self, obj: Any, attr: str, phase: str) -> None:
        inner = getattr(obj, attr)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            outer = self.phase
            if outer != "proximal":  # the proximal pass's forward counts as the proximal pass
                self.phase = phase
            try:
                return inner(*args, **kwargs)
            finally:
                self.phase = outer

        setattr(obj, attr, wrapped)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return dict(self.peaks)


class Resident:
    """A run's memory: the process's resident size, its high-water mark over the last update."""

    def __init__(self) -> None:
        self.reset, self.before = False, 0

    def last_update(self) -> None:
        self.reset = _reset_peak()
        self.before = _rss_bytes()

    def figures(self) -> tuple[int, int, int]:
        """(peak, added by the last update, before it), in bytes."""
        peak = _peak_bytes(self.reset)
        return peak, peak - self.before, self.before


class Traced:
    """A traced run's memory (bench/support/tracemem.py): the live tensor bytes plus `process`, the
    resident size before the model (the interpreter, its libraries, the batch)."""

    def __init__(self, live: Any, process: int) -> None:
        self.live, self.process, self.before = live, process, 0

    def last_update(self) -> None:
        self.live.reset_peak()
        self.before = self.live.live

    def figures(self) -> tuple[int, int, int]:
        return self.process + self.live.peak, self.live.peak - self.before, self.process + self.before


def worker(name: str, model_path: str, samples: int, seq_len: int, vocab: int, steps: int, lengths: str, budget: int,
           result: str, traced: bool = False) -> None:
    from services.trainer.intake.batch import shard
    from services.trainer.model.actor import PPOActor
    from services.trainer.model.engine import TrainEngine, import_deepspeed
    from services.trainer.settings import TrainerSettings

    extra: dict[str, Any] = dict(PATHS[name])
    if not name.startswith("today"):
        extra["max_tokens_per_microbatch"] = budget or seq_len
    b = batch(samples, seq_len, vocab, lengths)
    tokens = int(b["attention_mask"].sum())
    with ExitStack() as stack:
        meter: Resident | Traced = Resident()
        phases = PhasePeaks(sampled=not traced)
        if traced:
            from transformers import Qwen2ForCausalLM  # noqa: F401  (loaded before the process is measured)

            from bench.support import tracemem

            import_deepspeed()
            meter = Traced(stack.enter_context(tracemem.traced()), _rss_bytes())
            meter.live.listeners.append(lambda size: phases.record(meter.process + size))
        s = TrainerSettings.model_validate({"model_path": model_path, **extra})
        engine = TrainEngine(s)
        actor = PPOActor(engine, s.ppo)
        ds = engine.engine
        for obj, attr, phase in ((actor, "_device_logp", "proximal"), (ds, "forward", "forward"), (actor, "_loss", "logp+loss"),
                                 (ds, "backward", "backward"), (ds.optimizer, "independent_gradient_partition_epilogue", "zero-reduce"),
                                 (engine, "_clip", "step"), (ds, "step", "step")):
            if hasattr(obj, attr):  # no ZeRO (stage 0): no gradient partitions; the trainer's own clip counts as the step
                phases.wrap(obj, attr, phase)
        elapsed, cpu = 0.0, 0.0
        for i in range(steps):
            if i == steps - 1:  # the last update: its peak, and what it adds over the model and Adam states
                meter.last_update()
                phases.peaks.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            actor.ppo_update(shard(b, 1, 1)[0])
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        by_phase = phases.stop()
        peak, added, base = meter.figures()
    # a trace computes nothing: no time
    speed = {"tokens_per_s": None, "tokens_per_cpu_s": None} if traced else {"tokens_per_s": tokens / elapsed,
                                                                          "tokens_per_cpu_s": tokens / cpu}
    Path(result).write_text(json.dumps({"peak_bytes": peak, "added_bytes": added, **speed, "base_bytes": base,
                                        "traced": traced, "phase_peak_bytes": {p: by_phase.get(p, 0) for p in PHASES}}))
    sys.stdout.flush()
    os._exit(0)


def launch(name: str, model_path: str, args: argparse.Namespace, tmp: Path, traced: bool) -> dict:
    result = tmp / f"{name}{'-traced' if traced else ''}.json"
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "PYTHONPATH": str(REPO)}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, __file__, "--trace-worker" if traced else "--worker", name, model_path, str(args.samples),
           str(args.seq_len), str(args.vocab), str(args.steps), args.lengths, str(args.budget), str(result)]
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=6 * 3600)
    if proc.returncode != 0:
        how = " (traced)" if traced else ""
        raise RuntimeError(f"{name} path failed{how}:\n{proc.stdout.decode()[-2000:]}{proc.stderr.decode()[-3000:]}")
    return json.loads(result.read_text())


def _names(parser: argparse.ArgumentParser, option: str, value: str) -> list[str]:
    names = [n for n in value.split(",") if n]
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        parser.error(f"{option}: unknown {', '.join(unknown)} (known: {', '.join(PATHS)})")
    return names


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _cell(value: float | None, width: int, digits: int) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lengths", choices=["uniform", "varied"], default="uniform")
    parser.add_argument("--budget", type=int, default=0, help="the new path's max_tokens_per_microbatch (0: --seq-len)")
    parser.add_argument("--paths", default=DEFAULT_PATHS, help=f"run, comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--trace", default="", help="traced on fake tensors (no time), comma-separated: for a path this "
                                                    "machine cannot hold, or beside its run to check the trace")
    args = parser.parse_args()
    run, trace = _names(parser, "--paths", args.paths), _names(parser, "--trace", args.trace)
    for name in ("today", "new"):
        if name not in run and name not in trace:
            parser.error(f"{name} must be run (--paths) or traced (--trace): the score compares them")
    order = list(PATHS)
    jobs = sorted([(n, False) for n in run] + [(n, True) for n in trace], key=lambda j: (order.index(j[0]), j[1]))
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        model_path = build(tmp / "model", args.layers, args.vocab)
        rows = {f"{n}{' traced' if t else ''}": launch(n, model_path, args, tmp, t) for n, t in jobs}
    gib = 1024**3
    print(f"Qwen2-0.5B-shaped, {args.layers} layers, vocab {args.vocab}; {args.samples} samples x {args.seq_len} tokens "
          f"({args.lengths}); 1 CPU rank, float32; {args.steps} update(s), tokens/s of the last")
    budget = {"max_tokens_per_microbatch": args.budget or args.seq_len}
    for name in dict.fromkeys(n for n, _ in jobs):
        print(f"  {name:<9} {PATHS[name] | ({} if name.startswith('today') else budget)}")
    if trace:
        print("  traced: the path's code on fake tensors, its peak of live tensor bytes plus the process's resident size "
              "(bench/support/tracemem.py); nothing computed, so no time")
    # today's figures: its run where it ran, else its trace
    old = rows["today"] if "today" in run else rows["today traced"]
    new = rows["new"] if "new" in run else rows["new traced"]
    print(f"{'path':<17}{'peak GiB':>10}{'x today':>9}{'added GiB':>11}{'tokens/s':>11}{'tokens/CPU-s':>14}{'x today':>9}")
    for label, r in rows.items():
        print(f"{label:<17}{r['peak_bytes'] / gib:>10.2f}{r['peak_bytes'] / old['peak_bytes']:>9.3f}{r['added_bytes'] / gib:>11.2f}"
              f"{_cell(r['tokens_per_s'], 11, 1)}{_cell(r['tokens_per_cpu_s'], 14, 1)}"
              f"{_cell(_ratio(r['tokens_per_cpu_s'], old['tokens_per_cpu_s']), 9, 3)}")
    for name in run:
        if name in trace:
            print(f"  {name}: traced peak / measured peak {rows[name + ' traced']['peak_bytes'] / rows[name]['peak_bytes']:.3f}")
    print("peak GiB by phase of the update (run: resident size sampled every 5 ms; traced: at each allocation; "
          "before it: the weights, Adam, ZeRO's fp32 copy)")
    print(f"{'path':<17}{'before':>8}" + "".join(f"{p:>12}" for p in PHASES))
    for label, r in rows.items():
        print(f"{label:<17}{r['base_bytes'] / gib:>8.2f}" + "".join(f"{r['phase_peak_bytes'][p] / gib:>12.2f}" for p in PHASES))
    figures: dict[str, Any] = {
        "score": new["peak_bytes"] / old["peak_bytes"],
        "today_from": "trace" if "today" not in run else "run",
        "new_from": "trace" if "new" not in run else "run",
        "tokens_per_s_ratio": _ratio(new["tokens_per_s"], old["tokens_per_s"]),
        "tokens_per_cpu_s_ratio": _ratio(new["tokens_per_cpu_s"], old["tokens_per_cpu_s"]),
        "added_ratio": new["added_bytes"] / max(old["added_bytes"], 1),
    }
    for label, r in rows.items():
        key = label.replace("-", "_").replace(" ", "_")
        figures[f"{key}_peak_gib"] = r["peak_bytes"] / gib
        figures[f"{key}_peak_ratio"] = r["peak_bytes"] / old["peak_bytes"]
        figures[f"{key}_tokens_per_s"] = r["tokens_per_s"]
        figures[f"{key}_tokens_per_cpu_s"] = r["tokens_per_cpu_s"]
        figures[f"{key}_phase_peak_gib"] = {p: round(v / gib, 3) for p, v in r["phase_peak_bytes"].items()}
    figures.update({"layers": args.layers, "vocab": args.vocab, "samples": args.samples, "seq_len": args.seq_len,
                    "lengths": args.lengths, "budget": args.budget or args.seq_len})
    print(json.dumps(figures))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("--worker", "--trace-worker"):
        _, mode, name, path, samples, seq_len, vocab, steps, lengths, budget, result = sys.argv
        worker(name, path, int(samples), int(seq_len), int(vocab), int(steps), lengths, int(budget), result,
               traced=mode == "--trace-worker")
    else:
        main()
