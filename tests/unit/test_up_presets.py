"""`jetrl up`'s settings: the copy3 demo's preset goes with the demo only, a run on a dataset gets the
services' general defaults, and the effective settings are summarised at the start."""

from __future__ import annotations

from services.rollout.settings import RolloutSettings
from services.trainer.settings import TrainerSettings
from services.up.presets import DEMO_PRESET, preset_for, preset_name, section, summarize, summary_lines


def test_the_demo_gets_its_preset_and_a_dataset_run_does_not() -> None:
    assert preset_name("") == "copy3 demo" and preset_for("") == DEMO_PRESET
    for dataset in ("data/train.jsonl", "task:arith", "openai/gsm8k"):
        assert preset_name(dataset) is None and preset_for(dataset) == {}
    # a --config section overrides the preset key by key, nested sections merged
    merged = section(DEMO_PRESET, {"trainer": {"lr": 3e-3, "ppo": {"eps_clip": 0.1}}}, "trainer")
    assert merged["lr"] == 3e-3 and merged["batch_groups"] == 32
    assert merged["ppo"] == {"entropy_coef": 0.03, "eps_clip": 0.1}
    assert section({}, {}, "rollout") == {}


def test_general_defaults_are_not_the_toys() -> None:
    t = TrainerSettings.model_validate({"model_path": "unused"})
    r = RolloutSettings.model_validate({})
    assert t.lr == 1e-5 and t.ppo.entropy_coef == 0.0
    assert (t.lr, t.ppo.entropy_coef) != (DEMO_PRESET["trainer"]["lr"], DEMO_PRESET["trainer"]["ppo"]["entropy_coef"])
    assert r.max_new_tokens > DEMO_PRESET["rollout"]["max_new_tokens"]


def test_the_summary_names_what_a_run_trains_with() -> None:
    trainer = TrainerSettings.model_validate({"model_path": "m", "lr": 1e-4, "lora": {"enabled": True, "rank": 16}})
    full = TrainerSettings.model_validate({"model_path": "m"})
    rollout = RolloutSettings.model_validate({"group_size": 4, "max_new_tokens": 96})
    summary = summarize({"trainer": trainer, "rollout": rollout})
    assert summary["trainer"]["lr"] == 1e-4 and summary["trainer"]["lora.rank"] == 16
    assert summary["rollout"]["group_size"] == 4 and summary["rollout"]["max_new_tokens"] == 96
    assert "lora.rank" not in summarize({"trainer": full})["trainer"]  # LoRA's figures only when it is on
    lines = summary_lines(summary, None)
    assert lines[0].startswith("settings (no preset") and "lr=0.0001" in lines[1] and "max_new_tokens=96" in lines[2]
    assert "preset: copy3 demo" in summary_lines(summary, "copy3 demo")[0]
