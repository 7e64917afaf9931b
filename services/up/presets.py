"""What a `jetrl up` run trains with: the copy3 demo's preset (only for the demo), the `--config`
sections over it, and the concise summary of the effective settings printed at the start and kept in
`metrics.json`.

The services' own defaults are general ones (docs/trainer.md "Choosing settings"); the demo's are sized
for copy3 on the 4-token tiny model and apply only where the demo's own prompts are trained, i.e. when
no `dataset_path` is given (the copy3 prompts are generated in the run directory). A run on a dataset of
its own gets the services' defaults plus its `--config` sections, nothing of the demo's.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from services.common.settings import deep_merge

# The demo's settings (copy3 on the tiny model; docs/reference/tiny-model-rl.md); a --config section
# overrides any of them. Measured on copy3 (bench/README.md): at 16 prompts a step the steps to 0.9
# spread over 186-399 (a run can sit at ~0.8 for 100 steps with a digit locked on a wrong answer); at
# 32 they stay within ~150-190 (~30% more samples); lr 2e-3 is no faster than 1e-3. eta 2 lets
# generation overlap training (at eta 0 the trainer waits for data); the feeder keeps eta + 1 steps of
# prompts in flight. One rollout worker (`up.rollout_workers`) runs 64 episodes at once: the feeder's
# 96 prompts in flight are mostly waiting for their version, and a slot costs only memory. The
# entropy bonus keeps the tiny model from locking onto wrong digits.
DEMO_PRESET: dict[str, dict[str, Any]] = {
    "rollout": {"max_new_tokens": 4, "group_size": 8, "temperature": 1.0, "max_concurrent": 64},
    "trainer": {"batch_groups": 32, "eta": 2, "lr": 1e-3, "checkpoint_every": 50, "feeder": {"max_in_flight": 96},
                "ppo": {"entropy_coef": 0.03}},
}

# What the start-of-run summary shows per service (dotted paths into its settings).
SUMMARY_KEYS: dict[str, tuple[str, ...]] = {
    "trainer": ("model_path", "dtype", "lr", "lr_schedule", "warmup_steps", "batch_groups", "eta", "total_steps", "ppo.n_minibatches",
                "ppo.eps_clip", "ppo.entropy_coef", "ppo.kl_coef", "ppo.adv_norm", "ppo.loss_agg", "lora.enabled", "lora.rank",
                "lora.alpha", "max_tokens_per_microbatch", "pack_sequences", "logp_chunk_tokens", "gradient_checkpointing",
                "feeder.dataset_path", "feeder.max_in_flight", "feeder.eval_dataset_path", "feeder.eval_every", "feeder.eval_at_start",
                "feeder.eval_size", "checkpoint_every"),
    "rollout": ("workflow", "reward_fn", "group_size", "max_new_tokens", "temperature", "max_concurrent"),
    "inference": ("engine", "device", "dtype", "max_batch_size", "torch_threads"),
}


def preset_name(dataset_path: str) -> str | None:
    """The preset a run gets: "copy3 demo" when it trains the demo's own prompts (no dataset), else None."""
    return None if dataset_path else "copy3 demo"


def preset_for(dataset_path: str) -> dict[str, dict[str, Any]]:
    return DEMO_PRESET if preset_name(dataset_path) else {}


def section(preset: dict[str, dict[str, Any]], sections: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """A service's `--config` section over the preset's."""
    return deep_merge(preset.get(name, {}), sections.get(name, {}))


def _get(settings: BaseModel, path: str) -> Any:
    value: Any = settings
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def summarize(effective: dict[str, BaseModel]) -> dict[str, dict[str, Any]]:
    """The settings that matter most to what a run learns, per service, from its validated settings."""
    out: dict[str, dict[str, Any]] = {}
    for name, settings in effective.items():
        values = {key: _get(settings, key) for key in SUMMARY_KEYS.get(name, ())}
        out[name] = {k: v for k, v in values.items() if v is not None and not (k.startswith("lora.") and k != "lora.enabled"
                                                                               and not values.get("lora.enabled"))}
    return out


def summary_lines(summary: dict[str, dict[str, Any]], preset: str | None) -> list[str]:
    head = f"settings ({'preset: ' + preset if preset else 'no preset: service defaults'} + --config):"
    return [head, *(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in values.items()) for name, values in summary.items())]
