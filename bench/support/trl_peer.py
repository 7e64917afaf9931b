"""The TRL side of bench/vs_trl.py: one GRPOTrainer run in its own process.

    python -m bench.support.trl_peer SPEC.json

SPEC (written by bench/vs_trl.py) names the task (`copy3` or `arith`), the model directory, the
training and eval prompts (JSONL rows {"prompt", "answer"}), the settings, the seed and where to write
the result. Prompts are conversational (one user message), so TRL applies the model's own chat
template with the generation prompt, as jetrl's rollout does. The reward is jetrl's own function,
called in process. Written to SPEC["out"]: one record per step (mean reward, time from the bench's
launch, the step's seconds and the part of them in `_generate_and_score_completions`: generation and
scoring; the rest is training), the eval rounds (arith) and the process's peak resident size.
`dtype` bfloat16: transformers' bf16 mixed precision (autocast on the CPU; fp32 weights and optimizer).

The arith eval: before the first step and every `eval_every` steps, the first `eval_size` eval rows,
`group` samples each at the training temperature (no top-k / top-p, as jetrl's server samples), scored
with numeric_match; pass rate = the share scoring 1. Its time is taken off the clock (TRL stops for
it; jetrl's eval runs beside its training), so TRL's times never count its eval.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any


def reward_fn(task: str) -> Any:
    if task == "copy3":
        from services.common.demo_task import copy3_reward

        return copy3_reward
    from services.reward.builtin import numeric_match

    return lambda completion, answer: numeric_match(completion=completion, answer=answer)


def evaluate(model: Any, tok: Any, rows: list[dict[str, Any]], spec: dict[str, Any], score: Any) -> float:
    """Pass rate of `rows`, `group` samples each (generated in chunks of `eval_chunk` prompts)."""
    import torch

    tok.padding_side = "left"
    passed, total, chunk = 0, 0, int(spec.get("eval_chunk", 8))
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), chunk):
            part = rows[i : i + chunk]
            texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False)
                     for r in part]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, do_sample=True, temperature=spec["temperature"], top_k=0, top_p=1.0,
                                 max_new_tokens=spec["new_tokens"], num_return_sequences=spec["group"], pad_token_id=tok.pad_token_id)
            completions = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            for j, text in enumerate(completions):
                passed += int(score(text, part[j // spec["group"]]["answer"]) >= 1.0)
                total += 1
    if was_training:
        model.train()
    return passed / max(total, 1)


def main(spec_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    launched, task, seed = spec["launched"], spec["task"], spec["seed"]
    torch.set_num_threads(int(spec.get("threads", torch.get_num_threads())))
    torch.manual_seed(seed)
    score = reward_fn(task)
    rows = [json.loads(line) for line in Path(spec["dataset"]).read_text().splitlines()]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows])
    eval_rows = [json.loads(line) for line in Path(spec["eval"]).read_text().splitlines()][: spec["eval_size"]] if spec.get("eval") else []
    tok = AutoTokenizer.from_pretrained(spec["model"])
    policy = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)

    def reward(completions: list[Any], answer: list[str], **_: Any) -> list[float | None]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score(t, a) for t, a in zip(texts, answer, strict=True)]

    steps: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    clock = {"eval_s": 0.0, "gen_s": 0.0, "step_start": 0.0}
    target, lift = spec.get("target"), spec.get("lift")

    def now() -> float:
        return time.time() - launched - clock["eval_s"]

    class Record(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            clock["step_start"], clock["gen_s"] = time.time(), 0.0

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            steps.append({"step": state.global_step, "t": now(), "step_s": time.time() - clock["step_start"], "gen_s": clock["gen_s"]})
            if eval_rows and state.global_step % spec["eval_every"] == 0:
                run_eval(state.global_step, control)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any) -> None:
            if not (logs and "reward" in logs and steps):
                return
            steps[-1]["reward"] = logs["reward"]
            recent = [s["reward"] for s in steps[-10:] if "reward" in s]
            if task != "copy3" or state.global_step % 50 == 0:  # progress, shown by bench/vs_trl.py as it comes
                print(f"trl step {state.global_step}: reward {logs['reward']:.3f}, {steps[-1]['step_s']:.1f} s a step, "
                      f"{steps[-1]['t']:.0f} s on the clock", flush=True)
            if target is not None and len(recent) == 10 and sum(recent) / 10 >= target:
                control.should_training_stop = True

    def run_eval(step: int, control: Any) -> None:
        began = time.time()
        acc = evaluate(trainer.model, tok, eval_rows, spec, score)
        clock["eval_s"] += time.time() - began
        evals.append({"step": step, "t": now(), "eval_accuracy": acc, "eval_s": time.time() - began})
        print(f"trl eval step {step}: pass rate {acc:.3f}", flush=True)
        if lift is not None and control is not None and acc >= evals[0]["eval_accuracy"] + lift:
            control.should_training_stop = True

    lora = spec.get("lora")
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=0.0, bias="none",
                                 target_modules=lora["target_modules"], task_type="CAUSAL_LM")
    config = GRPOConfig(
        output_dir=str(Path(spec["out"]).parent / f"trl-{task}-{spec['batch']}-{seed}"),
        per_device_train_batch_size=spec["batch"] * spec["group"], num_generations=spec["group"], learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_completion_length=spec["new_tokens"],
        temperature=spec["temperature"], epsilon=spec["clip"], entropy_coef=spec["entropy"], loss_type="dapo", scale_rewards="group",
        beta=0.0, num_iterations=1, max_steps=spec["steps"], logging_steps=1, save_strategy="no", report_to="none", seed=seed,
        use_cpu=True, bf16=spec.get("dtype") == "bfloat16", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok,
                          callbacks=[Record()], peft_config=peft_config)
    generate = trainer._generate_and_score_completions

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
        began = time.time()
        try:
            return generate(*args, **kwargs)
        finally:
            clock["gen_s"] += time.time() - began

    trainer._generate_and_score_completions = timed_generate  # type: ignore[method-assign, unused-ignore]  # TRL is an extra: without it `trainer` is Any
    if eval_rows:
        run_eval(0, None)
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    Path(spec["out"]).write_text(json.dumps({"steps": steps, "evals": evals, "peak_rss_gib": peak, "eval_s": clock["eval_s"]}))


if __name__ == "__main__":
    main(sys.argv[1])
