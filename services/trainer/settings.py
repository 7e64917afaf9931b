"""Settings of `jetrl trainer` (`jetrl trainer --help` lists them with these docs)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from services.common.model_path import ModelPath
from services.common.settings import Section, ServiceSettings, flag
from services.weights.sender.settings import StoreSync, WeightSyncSettings, legacy_weights


class DatasetOptions(Section):
    split: str = "train"
    """Split of a saved DatasetDict or a hub dataset (ignored for JSONL/Parquet files)."""
    config: str | None = None
    """Hub dataset configuration (the second argument of `datasets.load_dataset`), e.g. "main" for gsm8k."""
    prompt_key: str = "prompt"
    """The row field that holds the prompt; copied to `prompt` (a row without it is passed on as it is,
    for workflows that read other fields, unless a key other than "prompt" was asked for)."""
    answer_key: str = "answer"
    """The row field that holds the reference answer; copied to `answer` (rows without it keep none)."""
    id_key: str = "id"
    """The row field with a stable row id; copied to `id` (rows without one get their index)."""
    transform: str = ""
    """A function `row -> row` run on every row before the key mappings ("pkg.module:fn", or
    "path/to/file.py:fn"); empty = none."""


class PPOSettings(Section):
    """The algorithm: how rewards become advantages and what per-token loss the update minimises.
    The default is GRPO advantages with AReaL's decoupled PPO objective; docs/algorithms.md maps each
    paper's algorithm (GRPO, Dr.GRPO, RLOO, REINFORCE++, GSPO, DAPO, dual clip) to these settings."""

    algorithm: str | None = None
    """A researcher's algorithm that replaces the advantages and/or the per-token loss: "pkg.module:Name"
    or "path/to/file.py:Name" (see docs/algorithms.md); None: the built-in one these settings describe."""
    algorithm_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for `algorithm` when it names a class (it is called as `Name(settings, **kwargs)`)."""
    n_minibatches: int = Field(1, ge=1)
    """Optimizer steps per trained batch (the batch is split into this many mini-batches)."""
    eps_clip: float = Field(0.2, gt=0)
    """PPO ratio clip: the ratio to the proximal policy is clipped to [1 - eps, 1 + eps_clip_high or eps]."""
    eps_clip_high: float | None = Field(None, gt=0)
    """Upper clip epsilon (DAPO's clip-higher, e.g. 0.28); None: the same as `eps_clip`."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip constant c > 1 (e.g. 3): for negative advantages the per-token loss is at most -c x A."""
    policy_loss: Literal["ppo", "gspo"] = "ppo"
    """ppo: token-level ratio and clip; gspo: sequence-level ratio exp(mean of the token log-ratios),
    clipped per sequence (GSPO; use a small eps_clip, e.g. 3e-4 / 4e-4, and seq-mean-token-mean)."""
    temperature: float = Field(1.0, gt=0)
    """Logits are divided by this before log-probs (must match the sampling temperature)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient. 0: a pretrained model samples diversely enough, and a bonus makes its
    replies drift (longer, noisier); the copy3 demo's preset sets 0.03 so the toy does not lock onto
    wrong digits."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty to the reference model (the initial weights); 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator of KL(policy || reference): k1 = log p - log p_ref; k2 = (log p - log p_ref)^2 / 2;
    k3 = exp(log p_ref - log p) - (log p_ref - log p) - 1."""
    kl_in: Literal["loss", "reward"] = "loss"
    """loss: kl_coef x KL (current policy) is added to the loss; reward: kl_coef x KL (behaviour policy)
    is subtracted from each token's reward before the advantages (REINFORCE++)."""
    adv_norm: Literal["grpo", "drgrpo", "rloo", "reinforce++"] = "grpo"
    """grpo: (r - group mean) / (group std + eps); drgrpo: r - group mean (no std division);
    rloo: r - mean of the other samples of the group (leave-one-out); reinforce++: per-token return
    (reward at the end, minus the KL penalties from each token on), normalised over the whole batch."""
    adv_batch_norm: bool = False
    """Also normalise the advantages over all loss tokens of the batch: (A - mean) / (std + adv_eps)."""
    adv_eps: float = Field(1e-6, gt=0)
    """Added to the std before dividing (grpo, reinforce++, adv_batch_norm)."""
    reward_scale: float = 1.0
    """Rewards become clip(reward_scale x (reward + reward_bias)) before the advantages."""
    reward_bias: float = 0.0
    """Added to each reward before scaling."""
    reward_clip: float | None = Field(None, gt=0)
    """Clip the scaled reward to [-reward_clip, reward_clip]; None: no clip."""
    overlong_max_tokens: int | None = Field(None, ge=1)
    """DAPO's overlong reward shaping: L_max, the longest response (loss tokens) without the full
    penalty; None: off. Needs `overlong_buffer`."""
    overlong_buffer: int = Field(0, ge=0)
    """L_cache: responses longer than L_max - L_cache lose (length - (L_max - L_cache)) / L_cache x
    overlong_penalty, the full overlong_penalty beyond L_max."""
    overlong_penalty: float = Field(1.0, ge=0)
    """Size of the full overlong penalty."""
    decoupled: bool = True
    """Decoupled objective (AReaL): the ratio is to the proximal policy (the one before the update's
    first optimizer step), each token weighted by proximal/behaviour; False is plain PPO against the
    behaviour log-probs."""
    recompute_proximal: bool = False
    """Give every micro-batch its own no-grad forward for the proximal log-probs before the update.
    False: the first mini-batch (all of them with n_minibatches=1) reuses its training forward's
    log-probs, which are the proximal policy's (no optimizer step yet), one forward per micro-batch
    fewer; done only when the forward is deterministic (no dropout), else recomputed anyway."""
    behav_imp_weight_cap: float | None = Field(5.0, gt=0)
    """Tokens whose importance weight proximal/behaviour exceeds this are masked (weight 0); None: no cap."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean"] = "token-mean"
    """token-mean: mean over all loss tokens of the mini-batch (DAPO's token-level loss);
    seq-mean-token-mean (alias seq-mean): mean per sequence, then over sequences; seq-mean-token-sum: sum per
    sequence, mean over sequences; seq-mean-token-sum-norm: sum per sequence / loss_agg_norm, mean over
    sequences (Dr.GRPO's constant normaliser)."""
    loss_agg_norm: float | None = Field(None, gt=0)
    """The constant of seq-mean-token-sum-norm (Dr.GRPO uses the generation budget, max new tokens)."""
    dynamic_filtering: bool = False
    """Drop groups whose rewards are all equal (zero advantage); counted as filtered and not re-issued
    (their slot goes to the next row), as in AReaL and DAPO's dynamic sampling."""

    @model_validator(mode="after")
    def _check(self) -> PPOSettings:
        if self.loss_agg == "seq-mean-token-sum-norm" and self.loss_agg_norm is None:
            raise ValueError("ppo.loss_agg seq-mean-token-sum-norm needs ppo.loss_agg_norm (e.g. the max new tokens)")
        if self.overlong_max_tokens is not None and not 0 < self.overlong_buffer <= self.overlong_max_tokens:
            raise ValueError("ppo.overlong_max_tokens needs ppo.overlong_buffer in 1..overlong_max_tokens")
        if self.algorithm is not None and ":" not in self.algorithm:
            raise ValueError(f"ppo.algorithm {self.algorithm!r}: expected 'pkg.module:Name' or 'path/to/file.py:Name'")
        if self.algorithm_kwargs and self.algorithm is None:
            raise ValueError("ppo.algorithm_kwargs is set but ppo.algorithm is not")
        return self


class FeederSettings(Section):
    """The prompt feeder: dataset, epochs, admission under the staleness budget, eval prompts."""

    dataset_path: str = ".jetrl/data/copy3.jsonl"
    """Training prompts: a JSONL or Parquet file of rows ({"id", "prompt", "answer", ...}), a 🤗 datasets
    directory written by `save_to_disk`, or a hub dataset name (with `dataset.config` and `dataset.split`)."""
    dataset: DatasetOptions = DatasetOptions()
    """How rows of `dataset_path` are read: split, hub config, key mappings, a row transform."""
    eval_dataset_path: str | None = None
    """Eval prompts (any source `dataset_path` takes); None: no eval prompts are issued."""
    eval_dataset: DatasetOptions = DatasetOptions(split="test")
    """How rows of `eval_dataset_path` are read (its split defaults to "test"; a file has no splits)."""
    eval_every: int = Field(0, ge=0)
    """Issue the eval set every this many steps (0: never)."""
    eval_at_start: bool = False
    """With `eval_every`: also issue the eval set before the first step of a fresh start (round
    `eval@0`, or the first version of a continued numbering), the baseline later rounds are read
    against (a resumed trainer does not issue it again)."""
    eval_size: int = Field(64, ge=1)
    """How many eval rows to issue each time (the first N of the eval set)."""
    eval_timeout_s: float = Field(300.0, gt=0)
    """An eval round is reported when every prompt is answered or this long after it was issued."""
    epochs: int = Field(0, ge=0)
    """Passes over the dataset; 0 means forever (reshuffled each epoch)."""
    shuffle: bool = True
    """Shuffle each epoch with `seed + epoch`."""
    max_in_flight: int = Field(64, ge=1)
    """Most training prompts issued and not yet answered (accepted or rejected)."""
    max_attempts: int = Field(3, ge=1)
    """Genuine failures per row at most: a row whose prompts failed (marker, malformed answer, dead
    letter, timed out) this many times is dropped, logged and counted (`feeder_dropped`, by cause)
    instead of re-issued. A stale group is not a failure: its row is re-issued uncharged."""
    in_flight_timeout_s: float = Field(1800.0, gt=0)
    """A training prompt unanswered this long (counted from its issue, or from a resume) is treated as
    rejected: counted (`feeder_timed_out`) and re-issued. Catches answers that can never come, e.g. a
    dead-letter advisory sent while the trainer was down."""
    enabled: bool = True
    """Run the feeder; False when prompts come from elsewhere (`jetrl prompts`, replay)."""


class LoRASettings(Section):
    """LoRA through peft: only the adapters train (base weights frozen, no Adam states for them); the
    published weights are the merged full weights (base + alpha / rank x B A), which every server loads
    as it loads any version. With the KL term on, the reference is the model with its adapters off."""

    enabled: bool = False
    """Train LoRA adapters instead of the full model."""
    rank: int = Field(16, ge=1)
    """r: the adapters' rank."""
    alpha: int = Field(32, ge=1)
    """lora_alpha: the update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"])
    """Names (or name suffixes) of the linear layers that get adapters, or ["all-linear"]; the default
    covers attention and MLP of Llama / Qwen / Mistral-style models. Linear layers only."""


class TrainerSettings(ServiceSettings):
    service = "trainer"
    publish_default: ClassVar[bool] = True
    """What the old `publish_weights` was when not given (for reading the old flat weight settings)."""

    model_path: ModelPath = ".jetrl/models/tiny"
    """HF model directory (config, safetensors, tokenizer): version 0 of the weights; also a name `jetrl
    models` lists or a hub id in the local HF cache (resolved to its directory)."""
    output_dir: str = ".jetrl/trainer"
    """Checkpoints (`checkpoints/`), staged weight dirs (`weights/`) and the step record live here."""
    zero_stage: Literal["auto", 0, 1, 2, 3] = "auto"
    """DeepSpeed ZeRO stage. 0 is no ZeRO (every rank holds the whole optimizer state; the gradients
    accumulate in the parameters): on one rank the leanest, as ZeRO-1/2 add an fp32 master copy and
    gradient partitions that one rank does not share. auto: the stage of the checkpoint being resumed,
    else 0 on one rank and 2 on several. A checkpoint resumes only on the stage it was written with."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training precision: bfloat16 turns on DeepSpeed's bf16 mode (bf16 forward/backward, fp32 master
    weights and Adam states in the optimizer): on a GPU, and on a CPU with native bf16 arithmetic (AVX512-BF16
    or AMX), where it halves a real model's matmul time (docs/trainer.md "Choosing settings"); float32 on
    other CPUs, which emulate bf16 slowly. fp16 is not offered."""
    publish_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the published weights (cast from the fp32 master copy): bfloat16 halves what is hashed,
    moved and loaded, for a server that serves in bf16."""
    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate. 1e-5 suits full fine-tuning of a pretrained model; LoRA takes ~10x more
    (1e-4), a randomly initialised toy ~1e-3 (the copy3 demo's preset); docs/trainer.md "Choosing settings"."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay (decoupled, applied to every parameter)."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """After warmup: constant lr, or cosine / linear decay to lr x lr_min_ratio over lr_decay_steps.
    Counted in optimizer steps (n_minibatches per trainer step)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup: step i (0-based) uses lr x (i + 1) / warmup_steps."""
    lr_decay_steps: int = Field(0, ge=0)
    """Optimizer steps (warmup included) by which cosine / linear decay reaches lr_min_ratio; 0: total_steps x
    ppo.n_minibatches (then total_steps must be set)."""
    lr_min_ratio: float = Field(0.0, ge=0, le=1)
    """The lr at the end of the decay, as a fraction of lr."""
    trim_free_mb: float = Field(256.0, ge=0)
    """After a step, the freed heap memory goes back to the system (`malloc_trim`) when the allocator holds
    at least this many MB of it: a real model's step frees hundreds of MB, which would otherwise stay with
    the process and grow it step after step; a small model's few MB are left to the allocator, since a
    trim makes the next step fault every page back in (services/trainer/model/memory.py). 0: every step."""
    max_tokens_per_microbatch: int = Field(0, ge=0)
    """Token budget (rows x padded length) of one forward/backward pass per rank: a rank's piece of a
    mini-batch is cut into micro-batches of at most this many tokens (a longer row goes alone) and
    their gradients accumulate into the mini-batch's one optimizer step; the loss is the same number.
    0: one pass per piece."""
    pack_sequences: bool = False
    """Pack each micro-batch's samples into one row (position ids restarting per sample, no padding
    computed; varlen attention with flash-attention-2, a block-diagonal causal mask with sdpa/eager);
    `max_tokens_per_microbatch` then counts the samples' real tokens. The log-probs and loss are those
    of the padded path."""
    pack_rounding: float = Field(0.125, ge=0, lt=1)
    """With `pack_sequences`: each packed row's length L (and with `share_prompts` its count of answer
    tokens) is rounded up to a multiple of the largest power of two at most `pack_rounding` x L, the
    extra tokens a sample of their own that nothing attends to or reads: at most that fraction more
    tokens, and a few lengths per doubling instead of a new one each step. On a CPU, oneDNN (which runs
    bf16 matmuls) builds and keeps a kernel per shape: a bf16 SmolLM2 trainer's memory grew 10-25 MB a
    step with a new length each step, and each new shape paid a kernel build. 0: no rounding."""
    share_prompts: bool = False
    """With `pack_sequences`: the samples of one prompt (a group) share a single copy of its tokens in
    the packed row, under a 4-D attention mask in which each answer sees its prompt and itself only; the
    model computes each prompt once per micro-batch instead of once per sample, and the log-probs come
    from the answer tokens only. The log-probs, loss and gradients are the padded path's. Pays when
    prompts are long against answers (a chat template, a question, short answers: ~3x fewer tokens at
    8 samples a prompt). sdpa or eager attention (not flash_attention_2, which takes no 4-D mask); the
    mask is (tokens x tokens) per micro-batch, so keep `max_tokens_per_microbatch` in the thousands."""
    attn_implementation: str | None = None
    """The model's attention kernel (transformers' `attn_implementation`): flash_attention_2 for varlen
    packed attention on GPUs with flash-attn installed, sdpa, eager; unset: transformers' default."""
    logp_chunk_tokens: int = Field(0, ge=0)
    """Log-probs and entropy are computed this many tokens at a time, without the whole float32
    (tokens x vocabulary) log-softmax (equal to 1e-5); 0: the whole vocabulary tensor at once."""
    fused_output_projection: bool = True
    """With `logp_chunk_tokens` > 0: the output projection (lm_head) is computed inside the chunked
    log-prob function, a chunk of tokens at a time, its weight gradient accumulated chunk by chunk, so
    the whole (tokens x vocabulary) logits and their gradient never exist. Falls back to the chunked
    function on the logits (saying why, once) where it cannot apply: ZeRO-3, an output projection that
    is not a plain Linear (e.g. LoRA on lm_head), soft-capped or scaled logits."""
    fused_keep_probs_mb: float = Field(256, ge=0)
    """With the fused output projection: a micro-batch's float32 (tokens x vocabulary) probabilities
    are kept from the forward to the backward pass when they take at most this many MiB (the backward
    then skips recomputing the logits, one output-projection matmul per token); larger, the backward
    recomputes them a chunk at a time. 0: always recompute."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them (HF gradient
    checkpointing): less memory for about one more forward pass; the gradients are unchanged."""
    reference_placement: Literal["device", "cpu", "zero3"] = "device"
    """Where the KL term's reference model lives (only loaded while ppo.kl_coef > 0): device, a full copy
    per rank; cpu, in host memory, moved to the device for an update's reference passes only; zero3,
    sharded over the ranks by DeepSpeed ZeRO-3 (1/world of it per rank). Unused with LoRA."""
    lora: LoRASettings = LoRASettings()
    """LoRA adapters through peft instead of full fine-tuning (see docs/trainer.md)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    batch_groups: int = Field(16, ge=1)
    """B: groups (prompts) per training step."""
    eta: int = Field(2, ge=0)
    """Staleness budget: groups with `version - head_version > eta` are dropped; 0 is on-policy."""
    seed: int = 0
    """Seeds the dataset shuffle and torch."""
    total_steps: int = Field(0, ge=0)
    """Stop after this many steps (0: until the dataset's epochs are exhausted, or forever)."""
    checkpoint_every: int = Field(50, ge=0)
    """Checkpoint every this many steps (0: only on SIGTERM)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk; older ones are deleted."""
    resume: str = Field("never", json_schema_extra=flag("--resume", bare="auto"))
    """auto: restart from the latest checkpoint in output_dir if there is one; never; or a checkpoint dir."""
    weights: WeightSyncSettings = StoreSync()
    """How each version reaches the inference servers: `weights.transport` is store (the WEIGHTS
    object store, the default), shared_dir, colocated, broadcast or none, each with its own settings
    beside it (docs/weights.md). The old flat settings (publish_weights, weights_shared_dir,
    weights_keep_last, weights_broadcast.*) are still read, with a warning."""
    weights_shard_mb: float | None = Field(None, gt=0)
    """Largest safetensors file of published weights (MB): a model in several files is hashed,
    copied and verified on every core. Unset: an eighth of the model, within 32-512 MB."""
    record_steps: bool = True
    """Append each step's prompt ids, version and last stream sequence to output_dir/steps.jsonl (an audit log)."""
    max_seq_len: int | None = Field(None, ge=1)
    """Longest trajectory row (tokens) the trainer accepts; a longer group is terminated and counted
    (`terminated_too_long`). Unset: the model config's `max_position_embeddings`."""
    max_abs_reward: float = Field(1e6, gt=0)
    """Largest |reward| a trained group may carry; a group beyond it is terminated and counted
    (`terminated_out_of_bounds`): no real reward comes near, and one finite 3e38 would make a step's
    reward mean (and `stop_at_reward`) meaningless (services/trainer/intake/validate.py)."""
    min_logprob: float = Field(-1e4, lt=0)
    """Lowest behaviour log-prob a trained token may carry (the highest is 0, plus 1e-3 of rounding); a
    group beyond it is terminated and counted (`terminated_out_of_bounds`). A sampler cannot draw a
    token below float32's ~-103 (services/trainer/intake/validate.py)."""
    fetch_batch: int = Field(16, ge=1)
    """Trajectory messages per pull request."""
    fetch_timeout_s: float = Field(1.0, gt=0)
    """How long one pull waits for trajectories before the loop checks for shutdown."""
    bus_retry_timeout_s: float = Field(300.0, gt=0)
    """How long a NATS publish or pull that fails with a retryable error (server restarting,
    reconnecting, timeout) is retried with capped backoff: the trainer rides out a bus outage this
    long; past it, it checkpoints and exits non-zero (`--resume auto` continues)."""
    ppo: PPOSettings = PPOSettings()
    feeder: FeederSettings = FeederSettings()

    @model_validator(mode="before")
    @classmethod
    def _legacy_weights(cls, data: Any) -> Any:
        """The flat weight settings of earlier releases, read as `weights` (with a warning)."""
        return legacy_weights(data, cls.publish_default)

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _stage_number(cls, value: object) -> object:
        """A stage given as text (an environment variable, a CLI override) is its number."""
        return int(value) if isinstance(value, str) and value.strip().isdigit() else value

    @model_validator(mode="after")
    def _check(self) -> TrainerSettings:
        if self.resume not in ("auto", "never") and not self.resume.strip():
            raise ValueError("resume: expected auto, never or a checkpoint directory")
        if self.feeder.enabled and self.feeder.eval_every and not self.feeder.eval_dataset_path:
            raise ValueError("feeder.eval_every is set but feeder.eval_dataset_path is not")
        if self.share_prompts and not self.pack_sequences:
            raise ValueError("share_prompts needs pack_sequences: true (the shared prompt lives in the packed row)")
        if self.share_prompts and self.attn_implementation == "flash_attention_2":
            raise ValueError("share_prompts needs attn_implementation sdpa or eager: flash_attention_2 takes no 4-D attention mask")
        if self.lr_schedule != "constant" and not (self.lr_decay_steps or self.total_steps):
            raise ValueError(f"lr_schedule {self.lr_schedule} needs lr_decay_steps or total_steps (the decay's length)")
        return self
