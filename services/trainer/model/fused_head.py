"""The output projection folded into the chunked log-prob function: from the last hidden states
straight to the chosen token's log-prob and the entropy, a chunk of tokens at a time.

`lean_logp_entropy` (services.trainer.model.logprobs) already avoids the whole float32 log-softmax, but it
starts from the logits: the model's output projection builds the whole (tokens x vocabulary) logits,
autograd hands back their whole gradient, and the projection's weight gradient is a dense (vocabulary
x hidden) tensor that autograd holds until a tied input embedding's gradient is added to it. Here the
function takes the hidden states h and the projection's weight W (and bias) itself: each chunk's
logits z = (h W^T + b) / temperature exist only while that chunk is processed, forward and backward
(which recomputes them), and the weight's gradient is accumulated chunk by chunk into one buffer, as
Liger's fused linear cross-entropy does. With p = softmax(z), for a chunk:
    d logp_y / dz = onehot(y) - p,   d H / dz = -p * (log p + H)
    grad_h = g W / temperature,      grad_W += g^T h / temperature,   grad_b += sum of g / temperature
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """A chunk's float32 scaled logits: the matmul in the weights' dtype (as the model's own output
    projection), then float32, divided in place."""
    z = F.linear(h, weight, bias).float()
    return z.div_(temperature) if temperature != 1.0 else z


class _HeadLogpEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                temperature: float, chunk: int, keep_bytes: int, into_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n, vocab = h.shape[0], weight.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=h.device)
        ent, lse = torch.empty_like(logp), torch.empty_like(logp)
        # The probabilities are kept for the backward pass when they fit `keep_bytes` (no gradient
        # wanted: a no-grad pass keeps nothing); otherwise the backward recomputes each chunk's logits.
        keep = any(ctx.needs_input_grad[:3]) and n * vocab * 4 <= keep_bytes
        probs = torch.empty(n, vocab, dtype=torch.float32, device=h.device) if keep else None
        for s in range(0, n, chunk):
            rows = slice(s, s + chunk)
            z = _logits(h[rows], weight, bias, temperature)
            # log-sum-exp by hand (torch.logsumexp builds a third chunk-sized temporary): e = exp(z -
            # max) is the one other one (kept: the probabilities' rows); entropy = lse - sum(e z) / sum(e)
            top = z.amax(-1, keepdim=True)
            e = (torch.sub(z, top, out=probs[rows]) if probs is not None else torch.sub(z, top)).exp_()
            total = e.sum(-1)
            lse[rows] = top.squeeze(-1) + total.log()
            logp[rows] = z.gather(-1, ids[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
            ent[rows] = lse[rows] - z.mul_(e).sum(-1) / total
            if probs is not None:
                e.div_(total.unsqueeze(-1))
            del z, e
        ctx.save_for_backward(h, weight, bias, ids, lse, ent)
        ctx.temperature, ctx.chunk, ctx.probs = temperature, chunk, probs
        ctx.param = weight if into_grad and weight.is_leaf else None
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor, g_ent: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, weight, bias, ids, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None
        # One weight-sized buffer, accumulated chunk by chunk (in the weight's dtype, as autograd's
        # own gradient of the projection would be). With `into_grad` the buffer is the parameter's
        # gradient itself (created at the first micro-batch, accumulated over the earlier ones after
        # it): this pass's is added to it in place and none is handed to autograd, which would hold
        # both and, for a tied lookup, add its gradient into a third; the lookup's gradient then goes
        # into the parameter's in place. Megatron-LM's gradient-accumulation fusion adds the weight
        # gradient into the accumulated one inside the backward the same way.
        if need_w and ctx.param is not None and ctx.param.grad is None:
            ctx.param.grad = torch.zeros_like(weight)
        held = _accumulated_grad(ctx.param) if need_w else None
        grad_w = held if held is not None else torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) if need_b else None
        g_logp, g_ent = g_logp.float(), g_ent.float()
        with_entropy = bool(g_ent.any())
        for s in range(0, h.shape[0], ctx.chunk):
            rows = slice(s, s + ctx.chunk)
            if ctx.probs is not None:
                g = _dz_from_probs(ctx.probs[rows], ent[rows], g_logp[rows], g_ent[rows], with_entropy)
            else:
                g = _dz_recomputed(_logits(h[rows], weight, bias, ctx.temperature), lse[rows], ent[rows], g_logp[rows], g_ent[rows])
            g.scatter_add_(-1, ids[rows].unsqueeze(-1), g_logp[rows].unsqueeze(-1))
            if ctx.temperature != 1.0:
                g.div_(ctx.temperature)
            if grad_b is not None:
                grad_b += g.sum(0)
            gz = g.to(h.dtype)
            del g
            if grad_h is not None:
                torch.matmul(gz, weight, out=grad_h[rows])
            if grad_w is not None:
                grad_w.addmm_(gz.t(), h[rows])
            del gz  # before the next chunk's logits: two chunk-sized buffers at a time, not three
        ctx.probs = None  # used up (overwritten): a second backward through this graph recomputes
        return (grad_h, None if held is not None else grad_w, grad_b.to(bias.dtype) if grad_b is not None else None,
                None, None, None, None, None)


def _dz_recomputed(g: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor, g_logp: torch.Tensor,
                   g_ent: torch.Tensor) -> torch.Tensor:
    """A chunk's d(loss)/dz but the chosen token's g_logp, from its recomputed logits (`g`, reused):
    -p * (g_logp + g_ent * (log p + H))."""
    g.sub_(lse.unsqueeze(-1))  # log p, in the logits' buffer
    p = torch.exp(g)
    return g.add_(ent.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1)).add_(g_logp.unsqueeze(-1)).mul_(p).neg_()


def _dz_from_probs(p: torch.Tensor, ent: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor,
                   with_entropy: bool) -> torch.Tensor:
    """The same from the forward's probabilities `p`, built in their buffer (read once):
    -(p g_logp + g_ent p (log p + H)), p log p taken as 0 where p underflowed to 0 (its limit)."""
    if not with_entropy:
        return p.mul_(g_logp.unsqueeze(-1)).neg_()
    t = torch.xlogy(p, p).addcmul_(p, ent.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1))
    return p.mul_(g_logp.unsqueeze(-1)).add_(t).neg_()


def _accumulated_grad(param: torch.Tensor | None) -> torch.Tensor | None:
    """The gradient autograd has accumulated in the parameter over earlier micro-batches, when this
    pass's weight gradient can be added to it in place (a plain dense tensor of the weight's kind)."""
    if param is None or param.grad is None:
        return None
    held = param.grad
    same = held.dtype == param.dtype and held.device == param.device and held.shape == param.shape
    return held if same and held.layout == torch.strided and held.is_contiguous() else None


def head_logp_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, input_ids: torch.Tensor,
                      temperature: float = 1.0, chunk_tokens: int = 1024, keep_mb: float = 0,
                      into_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy), each (B, T) float32 aligned with `input_ids` (0 at t = 0), from the last hidden
    states (B, T, hidden) and the output projection `weight` (vocabulary x hidden) and `bias`: the
    values and gradients (to `hidden`, `weight`, `bias`) of `lean_logp_entropy(hidden @ weight.T + bias)`,
    with at most `chunk_tokens` rows of vocabulary-sized tensors at a time. When the whole float32
    (tokens x vocabulary) probabilities take at most `keep_mb` MiB they are kept for the backward pass,
    which then skips recomputing the logits (one output-projection matmul per token). `into_grad`:
    the weight's gradient is added in place to the one already accumulated in `weight.grad` (when
    there is one), not handed to autograd: only where nothing hooks the weight's gradient
    accumulation (DeepSpeed without ZeRO: its ZeRO optimizers count every parameter's)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    b, t, d = hidden.shape
    # The whole (B*T, hidden) view; the last position's outputs are dropped, so its gradient is zero.
    ids = F.pad(input_ids[:, 1:].to(hidden.device).long(), (0, 1)).reshape(-1)
    logp, ent = _HeadLogpEntropy.apply(hidden.reshape(-1, d), weight, bias, ids, float(temperature), int(chunk_tokens),
                                      int(keep_mb * 2**20), into_grad)
    return (F.pad(logp.view(b, t)[:, :-1], (1, 0), value=0.0), F.pad(ent.view(b, t)[:, :-1], (1, 0), value=0.0))


def head_rows_logp_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                           temperature: float = 1.0, chunk_tokens: int = 1024, keep_mb: float = 0,
                           into_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`head_logp_entropy` for hidden states (K, hidden) given row by row, each predicting its own id of
    `ids` (K,) (no shift): (logp, entropy), each (K,) float32."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    logp, ent = _HeadLogpEntropy.apply(hidden, weight, bias, ids.to(hidden.device).long(), float(temperature),
                                      int(chunk_tokens), int(keep_mb * 2**20), into_grad)
    return logp, ent


HIDDEN_KWARGS: dict[str, Any] = {"output_hidden_states": True, "logits_to_keep": 1}
"""How the model is called when the loss owns the output projection: the hidden states out, the
logits of the last position only (HF causal LMs' `logits_to_keep`), not the whole (tokens x vocabulary)."""

# Config keys of models whose logits are not the output projection's alone (Gemma 2's soft-capping,
# Cohere's logit_scale, Granite's logits_scaling, MiniCPM-style multipliers).
_LOGIT_TRANSFORMS = ("softcap", "logit_scale", "logits_scaling", "scale_logits", "logit_multiplier", "output_multiplier")


def output_head(module: torch.nn.Module, zero_stage: int) -> tuple[torch.nn.Linear | None, str | None]:
    """(the output projection to fold into the log-prob function, None) when `module` (a HF causal LM,
    peft-wrapped or not, as the DeepSpeed engine holds it) can be fused, else (None, why not). Checked
    once: the projection is a plain Linear, its weight whole on this rank, the model takes
    `logits_to_keep`, nothing transforms the logits after it (no soft-capping or scaling in the
    config), and a probe forward's logits equal the projection of its last hidden states."""
    if zero_stage == 3:
        return None, "ZeRO-3 partitions the output projection's weight (only its own forward gathers it)"
    wrapper: Any = module
    model: Any = wrapper.get_base_model() if hasattr(wrapper, "get_base_model") else wrapper
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:  # a LoRA / peft wrapper, a custom head, or none
        return None, f"the output projection is a {type(head).__name__}, not a plain torch.nn.Linear"
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return None, f"{type(model).__name__}.forward takes no logits_to_keep"
    found = _logit_transform(model.config.to_dict())
    if found is not None:
        return None, f"the logits are transformed after the projection ({found})"
    if not _probe_matches(module, head):
        return None, "a probe forward's logits differ from the projection of its last hidden states"
    return head, None


def _logit_transform(config: dict[str, Any], prefix: str = "config.") -> str | None:
    for key, value in config.items():
        if isinstance(value, dict):
            found = _logit_transform(value, f"{prefix}{key}.")
            if found is not None:
                return found
        elif value is not None and value is not False and any(word in str(key).lower() for word in _LOGIT_TRANSFORMS) and value != 1:
            return f"{prefix}{key}={value}"
    return None


@torch.no_grad()
def _probe_matches(module: torch.nn.Module, head: torch.nn.Linear) -> bool:
    """A 4-token forward in eval mode: are its logits the projection of `hidden_states[-1]`?"""
    was_training = module.training
    module.eval()
    try:
        ids = torch.arange(4, device=head.weight.device).unsqueeze(0) % head.weight.shape[0]
        out = module(input_ids=ids, output_hidden_states=True, use_cache=False)
    finally:
        module.train(was_training)
    if out.hidden_states is None or out.logits is None:
        return False
    mine = F.linear(out.hidden_states[-1], head.weight, head.bias).float()
    return mine.shape == out.logits.shape and torch.allclose(mine, out.logits.float(), rtol=1e-4, atol=1e-5)
