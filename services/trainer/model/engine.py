"""`TrainEngine`: a DeepSpeed ZeRO (stage 1/2/3) engine around a HF causal LM, on CUDA where there is
a GPU and on CPU (gloo) here, at any world size.

Every method that touches parameters is collective: all ranks call it in the same order (ZeRO-3
gathers parameters during forward and when consolidating weights).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.common.logging import get_logger
from services.common.stores import init_default_group
from services.trainer.model import checkpoint as ckpt
from services.trainer.model import fused_head, lora, micro, packing, prompt_tree
from services.trainer.model import stage as zero
from services.trainer.model.reference import Reference
from services.trainer.model.schedule import scheduler
from services.trainer.settings import TrainerSettings
from services.weights.files import shard_bytes

log = get_logger("trainer.engine")

# Tokenizer and generation files copied next to published weights so a server can load the dir alone.
_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def import_deepspeed() -> Any:
    """Import DeepSpeed without the shm comm op build (~60 s, 1.5 GB on CPU; losses are identical
    without it: docs/reference/deepspeed-cpu.md). The accelerator follows what is present (CUDA when
    torch sees a GPU, else CPU) unless DS_ACCELERATOR says otherwise."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    import deepspeed

    comm_torch: Any = sys.modules["deepspeed.comm.torch"]
    comm_torch.build_shm_op = lambda: None
    # Gradient norms in float32: DeepSpeed casts each gradient to float64 before its norm, a transient
    # copy twice the size of the largest float32 gradient (the vocabulary x hidden embedding's: 1.1 GB
    # for a Qwen2-0.5B on the step's peak). float32 norms differ in the 7th digit.
    import deepspeed.runtime.zero.stage3 as stage3
    import deepspeed.runtime.zero.stage_1_and_2 as stage_1_and_2

    stage_1_and_2.get_norm_dtype = stage3.get_norm_dtype = lambda: torch.float32
    _import_muon_eager()
    return deepspeed


def _import_muon_eager() -> None:
    """DeepSpeed imports its Muon optimizer at the first use of any ZeRO optimizer (its support check,
    every gradient reduction), and that module `torch.compile`s its kernels as it is imported: torch's
    inductor and dynamo, ~1 CPU-s of every trainer's start (in the engine's build or in the first step)
    for an optimizer jetrl never builds (the engine's is AdamW). Imported here with DeepSpeed's own
    no-op decorator in place of `torch.compile`, its kernels stay eager; the module is otherwise the
    same (its classes, which DeepSpeed compares each optimizer against)."""
    if "deepspeed.runtime.zero.muon.original_muon" in sys.modules:
        return
    import deepspeed.runtime.compiler as ds_compiler

    compile_ = ds_compiler.compile
    ds_compiler.compile = lambda: ds_compiler.dummy_decorator
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except ImportError:  # a DeepSpeed without Muon
        pass
    finally:
        ds_compiler.compile = compile_


def init_distributed() -> tuple[int, int]:
    """(rank, world_size). Single-process runs need RANK/WORLD_SIZE/MASTER_* set too, else DeepSpeed
    looks for MPI; default them for world size 1."""
    deepspeed = import_deepspeed()
    if "WORLD_SIZE" not in os.environ:
        from services.common.ports import free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    init_default_group(backend)  # rank 0's store listens on MASTER_ADDR only; DeepSpeed then keeps this group
    deepspeed.init_distributed(dist_backend=backend)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


BUCKET_ELEMENTS_MAX = 500_000_000
"""DeepSpeed's default reduce / all-gather bucket (elements)."""


def bucket_elements(n_params: int) -> int:
    """ZeRO's reduce and all-gather bucket sizes, in elements, scaled to the model: a sixteenth of its
    trainable parameters (at least 1M, at most DeepSpeed's default 5e8). The default bucket is larger
    than a sub-2B model's whole gradient, so every gradient goes through it and is then copied again
    into the rank's partition: a second whole gradient at the end of each backward pass. A
    parameter larger than the bucket (the embedding) is reduced in place, without a bucket copy."""
    return max(1_000_000, min(BUCKET_ELEMENTS_MAX, n_params // 16))


def ds_config(settings: TrainerSettings, n_params: int = 0) -> dict[str, Any]:
    """DeepSpeed's config; `n_params` (the trainable parameters) sizes the ZeRO buckets (0: defaults)."""
    zero: dict[str, Any] = {"stage": settings.zero_stage, "stage3_gather_16bit_weights_on_model_save": True}
    if n_params:
        zero["reduce_bucket_size"] = zero["allgather_bucket_size"] = bucket_elements(n_params)
    cfg: dict[str, Any] = {
        # Mini-batches are formed by the trainer, one optimizer step each: DeepSpeed's own batch
        # bookkeeping is nominal here.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # Without ZeRO in float32 DeepSpeed clips but keeps no norm: `TrainEngine` clips there itself.
        "gradient_clipping": 0.0 if plain_optimizer(settings) else settings.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if settings.dtype == "bfloat16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def plain_optimizer(settings: TrainerSettings) -> bool:
    """ZeRO stage 0 in float32: DeepSpeed steps the torch optimizer on the module's own parameters
    (no fp32 master copy, no gradient partitions) and the gradients accumulate in `param.grad` over a
    mini-batch's micro-batches, with nothing hooked to them."""
    return settings.zero_stage == 0 and settings.dtype == "float32"


def sparse_tied_lookup(model: Any) -> None:
    """With tied input and output embeddings (`model` a HF PreTrainedModel), make the input lookup's gradient sparse (the rows the
    batch used). autograd sums the output projection's dense (vocabulary x hidden) gradient with the
    lookup's before the parameter's gradient is written, so the sum is dense and identical; the
    lookup's own dense vocabulary-sized gradient (a transient as large as the embedding) is never
    built. Untied embeddings are left alone: their gradient would reach ZeRO sparse."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(inp, torch.nn.Embedding) and out is not None and out.weight is inp.weight:
        inp.sparse = True


class TrainEngine:
    """The model, its optimizer and their distribution. `train_batch` runs one optimizer step per
    mini-batch with a caller-given loss; `forward` gives logits without gradients."""

    def __init__(self, settings: TrainerSettings) -> None:
        from transformers import AutoModelForCausalLM

        self.rank, self.world_size = init_distributed()
        found = ckpt.resolve_resume(settings.resume, settings.output_dir)
        stage = zero.resolve(settings.zero_stage, self.world_size, found[0] / found[1] if found else None)
        # `zero_stage` is a number from here on, for everything that reads the engine's settings.
        settings = self.settings = settings.model_copy(update={"zero_stage": stage})
        self.stage: int = stage
        self.device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")
        deepspeed = import_deepspeed()
        torch.manual_seed(settings.seed)
        # Built in full on every rank, then partitioned by deepspeed.initialize: a bare zero.Init would
        # skip HF's weight init (docs/reference/deepspeed-cpu.md); loading a checkpoint is exact anyway.
        model = AutoModelForCausalLM.from_pretrained(settings.model_path, dtype=torch.float32,
                                                     attn_implementation=settings.attn_implementation)
        if settings.gradient_checkpointing:
            # non-reentrant: works with inputs that need no grad and under ZeRO-3's parameter hooks
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        sparse_tied_lookup(model)
        if settings.lora.enabled:
            model = lora.apply(model, settings.lora)
        # Frozen parameters (the base weights under LoRA) get no Adam states.
        params = [p for p in model.parameters() if p.requires_grad]
        # fused: one kernel over ZeRO's flat fp32 partition; the unfused AdamW builds partition-sized
        # temporaries (sqrt of the second moment, the denominator) on top of the states in every step.
        optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay,
                                      betas=settings.adam_betas, eps=settings.adam_eps, fused=True)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(settings, sum(p.numel() for p in params)),
                                               lr_scheduler=scheduler(settings, optimizer))
        self.grads_in_params = plain_optimizer(settings)
        self._trainable = params
        if self.grads_in_params and self.world_size == 1:
            # One rank has nothing to all-reduce; DeepSpeed would still copy every gradient into a
            # flat bucket and back at the end of each mini-batch.
            self.engine.enable_backward_allreduce = False
        self.ref_model: Reference | None = None
        if settings.ppo.kl_coef > 0:  # no KL term, no reference model on any rank
            self.ref_model = Reference(settings, self.device, self.world_size, deepspeed,
                                       lora_engine=self.engine if settings.lora.enabled else None)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        return packing.model_inputs(batch, self.device, torch.bfloat16 if self.settings.dtype == "bfloat16" else torch.float32)

    @torch.no_grad()
    def forward(self, batch: dict[str, Any], *, reference: bool = False, hidden: bool = False) -> torch.Tensor:
        """Logits (float32) for a padded batch, or its packed row when `batch` is packed (see
        `services.trainer.model.packing`), without gradients; `reference` uses the frozen reference model;
        `hidden`: the last hidden states instead (see `_outputs`)."""
        if reference:
            if self.ref_model is None:
                raise RuntimeError("forward(reference=True) needs ppo.kl_coef > 0 (no reference model loaded)")
            return self.ref_model.logits(self._inputs(batch))
        was_training = self.engine.module.training
        self.engine.module.eval()
        try:
            out = self._outputs(batch, hidden)
            return out if hidden else out.float()
        finally:
            self.engine.module.train(was_training)

    def _outputs(self, batch: dict[str, Any], hidden: bool) -> torch.Tensor:
        """The model's logits, or with `hidden` its last hidden states, the logits left to the loss
        (`services.trainer.model.fused_head`: only the last position's are computed here)."""
        if hidden:
            return self.engine(**self._inputs(batch), **fused_head.HIDDEN_KWARGS).hidden_states[-1]
        return self.engine(**self._inputs(batch)).logits

    def micro_batches(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        """This rank's piece of a mini-batch cut by `max_tokens_per_microbatch` (one micro-batch when
        0), each packed into one row with `pack_sequences`. Collective when the budget is on and there
        are several ranks: every rank gets as many micro-batches as the rank that needs the most
        (ZeRO-3 gathers parameters in every pass)."""
        budget, packed, share = self.settings.max_tokens_per_microbatch, self.settings.pack_sequences, self.settings.share_prompts
        rounding = self.settings.pack_rounding
        if budget <= 0:
            return [packing.pack(piece, share_prompts=share, rounding=rounding)] if packed else [piece]
        sizes = packing.lengths(piece)
        # Shared prompts: a row whose prompt is already in the micro-batch costs its answer only.
        groups = (prompt_tree.plan(prompt_tree.prompt_keys(piece, sizes), sizes, budget) if share and packed
                  else micro.plan(sizes, budget, packed=packed))
        if self.world_size > 1:
            count = torch.tensor([len(groups)], dtype=torch.int64, device=self.device)  # NCCL reduces GPU tensors only
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
            groups = micro.widen(groups, int(count.item()))
        micros = micro.split(piece, groups)
        return [packing.pack(m, share_prompts=share, rounding=rounding) for m in micros] if packed else micros

    def train_batch(
        self,
        minibatches: list[list[dict[str, Any]]],
        loss_fn: Callable[[torch.Tensor, dict[str, Any]], tuple[torch.Tensor, dict[str, Any]]],
        *,
        hidden: bool = False,
    ) -> tuple[list[dict[str, Any]], list[float]]:
        """One optimizer step per mini-batch, given as its micro-batches (`micro_batches`): for each,
        forward, `loss_fn(logits, micro) -> (loss, stats)`, backward (gradients accumulate); then step.
        Returns the per-mini-batch stats (micro-batch stats merged) and the global grad norms (before
        clipping). `hidden`: the loss gets the last hidden states instead of the logits (`_outputs`)."""
        self.engine.train()
        stats, norms = [], []
        for micros in minibatches:
            mb_stats = []
            for i, mb in enumerate(micros):
                if len(micros) > 1:  # reduce and step only after the last micro-batch
                    self.engine.set_gradient_accumulation_boundary(i == len(micros) - 1)
                logits = self._outputs(mb, hidden)
                loss, s = loss_fn(logits, mb)
                del logits
                self.engine.backward(loss)
                mb_stats.append(s)
            if self.grads_in_params:  # the trainer clips (DeepSpeed would, keeping no norm), then steps
                norm = self._clip()
                self.engine.step()
            else:  # DeepSpeed clips inside its step and keeps the norm
                self.engine.step()
                norm = self.engine.get_global_grad_norm()
            norms.append(float(norm) if norm is not None else float("nan"))
            stats.append(micro.merge_stats(mb_stats))
        return stats, norms

    def _clip(self) -> float:
        """Without ZeRO: clip the (already all-reduced) gradients to `grad_clip`; their global norm."""
        return float(torch.nn.utils.clip_grad_norm_(self._trainable, self.settings.grad_clip, foreach=True))

    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return float(self.engine.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------------------ checkpoints

    def save(self, directory: str | Path, tag: str, client_state: dict[str, Any]) -> None:
        """DeepSpeed checkpoint (model, optimizer, per-rank partitions) plus `client_state`, and the
        ZeRO stage it is written with; collective."""
        if self.is_main:
            zero.record(Path(directory) / tag, self.stage)
        self.engine.save_checkpoint(str(directory), tag=tag, client_state=client_state)

    def load(self, directory: str | Path, tag: str | None = None) -> dict[str, Any]:
        """Restore model and optimizer; returns the client_state saved with them. Collective."""
        path, client_state = self.engine.load_checkpoint(str(directory), tag=tag)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag or '(latest)'} in {directory}")
        return client_state or {}

    # ------------------------------------------------------------------------------ weights out

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full float32 weights on rank 0 (None elsewhere), from the fp32 master copy of whichever
        ZeRO stage. Collective: every rank must call it."""
        from deepspeed.utils import safe_get_full_fp32_param

        out: dict[str, torch.Tensor] = {}
        if self.world_size == 1 and self.stage < 3 and self.settings.dtype == "float32":
            # One rank training in float32 without ZeRO or under ZeRO-1/2: the module's parameters
            # are the master copy, bit for bit. Reading them costs no collective per parameter, each of which also
            # hands the GIL back and forth with the event loop (a background publish) on a busy machine.
            out = {name: param.detach().cpu().clone() for name, param in self.engine.module.named_parameters()}
            return lora.merge(out, self.settings.lora) if self.settings.lora.enabled else out
        for name, param in self.engine.module.named_parameters():
            full = safe_get_full_fp32_param(param)
            if full is None:  # before the first step the optimizer may hold no hp mapping: use the module
                import deepspeed

                with deepspeed.zero.GatheredParameters([param]):
                    full = param.detach().float().clone()
            if self.is_main:
                out[name] = full.detach().cpu().clone()
        if self.is_main and self.settings.lora.enabled:  # published as merged full weights, base names
            out = lora.merge(out, self.settings.lora)
        return out if self.is_main else None

    def upload_weights(self, out_dir: str | Path) -> Path | None:
        """Gather the weights and write a HF checkpoint dir (`publish_dtype` safetensors + config + tokenizer)
        on rank 0; returns its path on rank 0, None elsewhere. Collective."""
        sd = self.full_state_dict()
        if not self.is_main:
            return None
        assert sd is not None
        out = Path(out_dir)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        module = lora.base_model(self.engine.module)  # a plain HF dir, also under LoRA
        dtype = self.settings.publish_dtype
        if dtype != "float32":  # cast from the fp32 master copy, once, as the server will hold them
            sd = {k: v.to(getattr(torch, dtype)) for k, v in sd.items()}
        module.config.dtype = dtype
        # transformers pops tensors out of the dict it is given: pass a copy.
        mb = self.settings.weights_shard_mb
        shard = int(mb * 1e6) if mb is not None else shard_bytes(sum(t.numel() * t.element_size() for t in sd.values()))
        module.save_pretrained(out, state_dict=dict(sd), safe_serialization=True, max_shard_size=shard)
        if dtype != "float32":  # save_pretrained writes the module's own (float32) dtype into the config
            module.config.dtype = dtype
            module.config.to_json_file(out / "config.json")
        src = Path(self.settings.model_path)
        for name in _SIDE_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, out / name)
        return out
