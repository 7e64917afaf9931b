"""Settings of `jetrl inference`: the SGLang-protocol server on transformers (on a GPU, or the CPU
stand-in for machines without one), or real SGLang launched with these settings."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, SecretStr, model_validator

from services.common.model_path import ModelPath
from services.common.settings import Section, ServiceSettings
from services.common.signing import load_key
from services.inference.auth import is_loopback


class SimulateSettings(Section):
    token_latency_s: float = 0.01
    """Time one decode step takes (every running request gets one token per step, as on a GPU)."""
    prefill_latency_s: float = 0.0
    """Extra time a step takes when it admits new requests."""
    vocab_size: int = 48
    """Token ids are drawn from [3, vocab_size); 2 is the end-of-sequence id."""
    eos_token_id: int = 2
    """Token id a simulated completion ends with (finish `stop`)."""
    median_new_tokens: float = 32.0
    """Median completion length of the long-tailed (log-normal) length distribution."""
    length_sigma: float = 1.0
    """Log-normal sigma: larger means a longer tail of long completions."""


class InferenceSettings(ServiceSettings):
    service: ClassVar[str] = "inference"

    engine: Literal["cpu", "sglang"] = "cpu"
    """`cpu`: this CPU server. `sglang`: run real SGLang (`python -m sglang.launch_server`, needs the
    `sglang` package and a CUDA GPU) with these settings as its flags; see docs/sglang.md."""
    sglang_args: list[str] = []
    """Extra `sglang.launch_server` flags with `engine: sglang` (e.g. `--tp-size=2`, `--mem-fraction-static=0.8`)."""
    model_path: ModelPath = ".jetrl/models/tiny"
    """HF model directory (config.json + safetensors, sharded or not [+ tokenizer]), a name `jetrl models`
    lists (made by `jetrl make-model NAME`) or a hub id in the local HF cache; `jetrl make-model` builds the default."""
    host: str = "127.0.0.1"
    """Address to listen on. Beyond loopback the server refuses to start without `admin_api_key` or
    `api_key`: its admin routes swap the weights and pause generation (docs/security.md)."""
    api_key: SecretStr = SecretStr("")
    """As SGLang's `--api-key`: every route but health/readiness needs `Authorization: Bearer <key>`
    (the admin routes too, unless `admin_api_key` is set). Prefer `api_key_file` or the environment."""
    api_key_file: str = ""
    """File holding `api_key`."""
    admin_api_key: SecretStr = SecretStr("")
    """As SGLang's `--admin-api-key`: the admin routes (`update_weights_*`, `pause_generation` /
    `continue_generation`, `abort_request`, `flush_cache`, the distributed weight-update group) need
    this key, and `api_key` is not accepted there. Give the same key to the weights agent and the
    trainer (`trust.inference_admin_api_key`)."""
    admin_api_key_file: str = ""
    """File holding `admin_api_key`."""
    port: int = 30000
    """Port to listen on (0 picks a free one; the chosen port is logged)."""
    weight_version: str = "0"
    """Weight version the loaded model serves until the first /update_weights_from_disk."""
    max_batch_size: int = 256
    """Most requests decoded together in one step; more wait in the queue. A step's fixed cost (the
    model's Python, the thread hand-off) is shared by its rows: the demo's 256 samples a trainer step
    take 4 steps at 256 rows, against 16 at 64 (measured: about 25% less server CPU per sample)."""
    seed: int = 0
    """Seed of the server's sampler for requests without `sampling_seed`."""
    torch_threads: int = 1
    """torch intra-op threads of the decode thread."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where this server's model runs: `cuda` (the first visible GPU; `CUDA_VISIBLE_DEVICES` picks
    another) makes it a transformers server on the GPU, `cpu` the stand-in for machines without one.
    Sampling runs on the CPU either way (float32 logits), so seeded requests draw alike."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype the model is served in (the weights are cast on load and on every update): bfloat16
    on a GPU and on a CPU with AVX512-BF16 or AMX (a real model's prefill ~2x, decoding ~1.3x faster);
    float32 on other CPUs, which emulate bf16 slowly. With `engine: sglang`, anything but
    float32 is passed as `--dtype`. The trainer's `weights.dtype` should match it."""
    memory_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """device cuda: the most of the GPU's memory this server's torch allocator may take
    (`torch.cuda.set_per_process_memory_fraction`), e.g. 0.3 when it shares one GPU with the trainer;
    0: no limit."""
    attn_implementation: str = ""
    """transformers' attention implementation (`sdpa`, `eager`, `flash_attention_2` where installed);
    empty: transformers' default. (With `engine: sglang` use `sglang_args` `--attention-backend=...`.)"""
    context_length: int = 0
    """Longest prompt + completion; 0 means the model's max_position_embeddings."""
    skip_tokenizer_init: bool = False
    """As SGLang's `--skip-tokenizer-init` (passed to it with `engine: sglang`): token ids only, no `text`
    in replies, `stop` strings / `min_new_tokens` refused with SGLang's 400, and no grammar backend, so
    `json_schema` / `regex` / `ebnf` are refused too (SGLang's rule). `jetrl up` sets it unless the
    rollout workflow is an agent or declares `needs_grammar`; its `inference:` section can override."""
    health_check_timeout_s: float = 20.0
    """How long `/health` waits for a paused server to go on before answering 503: SGLang's `/health`
    runs a one-token generation, which waits out a pause the same way (`/ready` answers at once)."""
    sglang_version: str = "0.5.23"
    """The SGLang version whose protocol this server speaks, reported as `version` by `/server_info`."""
    simulate: bool = False
    """Serve the protocol with no model: random tokens at `sim.token_latency_s` per step (for benchmarks)."""
    sim: SimulateSettings = SimulateSettings()
    """Simulation knobs (used when `simulate` is true)."""
    weights_group_timeout_s: float = Field(60.0, gt=0)
    """Deadline of the gloo weight-update group: joining it, and each broadcast received over it. A
    trainer that dies mid-broadcast costs the server at most this; its old weights keep serving."""

    @model_validator(mode="after")
    def _check(self) -> InferenceSettings:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.torch_threads < 1:
            raise ValueError("torch_threads must be >= 1")
        api, admin = self.keys()
        if not is_loopback(self.host) and not (api or admin):
            # Refused, not warned: a warning nobody reads would leave the weight-swap route open to
            # whoever reaches the address; the fix is one setting.
            raise ValueError(f"host {self.host} listens beyond loopback, and neither admin_api_key nor api_key is set: "
                             "anyone who reaches it could swap the weights or pause generation; set admin_api_key "
                             "(or admin_api_key_file) and give the weights agent the same trust.inference_admin_api_key")
        return self

    def keys(self) -> tuple[str, str]:
        """(api_key, admin_api_key), each from its setting or its file; empty when unset."""
        return (load_key(self.api_key, self.api_key_file, "api_key").decode(),
                load_key(self.admin_api_key, self.admin_api_key_file, "admin_api_key").decode())
