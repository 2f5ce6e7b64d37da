"""Per-token log-probabilities of the targets from the final hidden states, in row chunks of the LM head.

Where it sits: inside the LM head's call of a patched causal LM scored by a post-training
objective (`integrations/logprob_head.py`): DPO's per-document sums, GRPO's (and RLOO's)
per-token ratios and KL, both models' (policy and frozen reference). FPDT's chunked loss
(§3.5) for a per-token output: each row chunk's logits are computed, reduced to what the
objective reads, and dropped; the backward recomputes the chunk's logits.
Guarantees: the numerics of the unchunked path the objectives used (`lm_head` in the hidden
dtype, the model's scaling and Gemma2's softcap in that dtype, then fp32, divided by the
temperature, log-softmax),
per token; at most one chunk of `[chunk, V]` logits alive, forward and backward; the
statistics ("entropy", "mean_logit", "is_top1") carry no gradient; the weight gradient is
summed in fp32 over the chunks. Chunk sizes follow `ops/loss_rows.loss_chunk_rows`."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hf_longctx.ops.chunked_loss import chunk_logits, mapped
from hf_longctx.ops.grad_sums import GradSums, sink_linear

STATS = ("entropy", "mean_logit", "is_top1")


def _scaled(h: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None, temperature: float,
            maps: tuple = ()) -> Tensor:
    """fp32 [n, V] logits of one chunk divided by the temperature (x / 1.0 is exact: DPO's path)."""
    return chunk_logits(h, weight, bias, softcap, maps=maps) / temperature


def _logits_grad(logits: Tensor, targets: Tensor, grad: Tensor, temperature: float) -> Tensor:
    """[c, V] gradient of Σ grad_i · log_softmax(logits.float() / T)[i, t_i] w.r.t. `logits`, in
    their dtype: (onehot(t) - softmax) · grad / T, written over one fp32 buffer the way autograd
    computes it (log-softmax's backward: grad_out - exp(out) · Σ grad_out), so two fp32 [c, V]
    tensors at most instead of autograd's four."""
    with torch.no_grad():
        z = logits.float() / temperature  # [c, V] fp32
        g = grad.to(z.dtype)[:, None]  # [c, 1]
        buf = torch.log_softmax(z, dim=-1)
        del z
        buf.exp_().mul_(-g).scatter_add_(1, targets[:, None], g)  # -p·g, and + g at the target
        return buf.div_(temperature).to(logits.dtype)


def _acc(g: Tensor) -> Tensor:
    """A chunk's parameter gradient as the accumulator of the sum over chunks: fp32 at least (one
    rounding per chunk in bf16 would not match the unchunked GEMM's sum)."""
    return g.to(torch.promote_types(g.dtype, torch.float32))


def _autocast_state(device: torch.device) -> tuple[str, bool, torch.dtype]:
    kind = device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """(log-probs [N] fp32, statistics [N, k] fp32) of `hidden` [N, Hd] through the head, chunk by chunk.

    Forward: per chunk, logits -> log-softmax -> the target's entry (and the statistics), no graph
    kept. Backward: per chunk, the head's logits again under autograd (the forward's autocast
    state replayed), their gradient from the log-softmax's in closed form (`_logits_grad`), then
    autograd through the head. Saved: the inputs only."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_size: int,
                temperature: float, softcap: float | None, stats: tuple,
                maps: tuple = ()) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        n = hidden.shape[0]
        logps = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        extra = torch.zeros(n, len(stats), dtype=torch.float32, device=hidden.device)  # [N, k]
        with torch.no_grad():
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                z = _scaled(hidden[start:end], weight, bias, softcap, temperature, maps)  # [c, V] fp32
                t = targets[start:end, None]  # [c, 1]
                for i, name in enumerate(stats):  # before the log-softmax: z is freed after it
                    if name == "mean_logit":
                        extra[start:end, i] = z.mean(-1)
                    elif name == "is_top1":
                        extra[start:end, i] = (z.argmax(-1) == t[:, 0]).float()
                logp = torch.log_softmax(z, dim=-1)  # [c, V] fp32
                del z
                logps[start:end] = logp.gather(-1, t)[:, 0]
                if "entropy" in stats:
                    extra[start:end, stats.index("entropy")] = -(logp.exp().mul_(logp)).sum(-1)  # -Σ p log p
                del logp
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk_size, ctx.temperature, ctx.softcap, ctx.maps = chunk_size, temperature, softcap, maps
        ctx.autocast = _autocast_state(hidden.device)
        ctx.mark_non_differentiable(extra)
        return logps, extra

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_logps: Tensor, grad_extra: Tensor) -> tuple:  # type: ignore[override]
        hidden, weight, bias, targets = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = bool(need_b and bias is not None)
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, Hd]
        # [V, Hd] sum over chunks, fp32 (fp64 for fp64 weights): each chunk's weight-gradient GEMM
        # writes into it (ops/grad_sums.py), no weight-sized gradient per chunk
        sums = GradSums([weight]) if need_w else None
        grad_b: Tensor | None = None
        w_leaf = weight.detach().requires_grad_(need_w)
        b_leaf = bias.detach().requires_grad_(need_b) if bias is not None else None
        kind, enabled, dtype = ctx.autocast
        autocast = torch.autocast(kind, dtype=dtype, enabled=True) if enabled else nullcontext()
        n = hidden.shape[0]
        for start in range(0, n, ctx.chunk_size):
            end = min(start + ctx.chunk_size, n)
            h_leaf = hidden[start:end].detach().requires_grad_(need_h)  # [c, Hd]
            with torch.enable_grad(), autocast:  # the head (and softcap) in the compute dtype, under autograd
                logits = (F.linear(h_leaf, w_leaf, b_leaf) if sums is None  # [c, V]
                          else sink_linear(h_leaf, w_leaf, b_leaf, sums, 0))
                logits = mapped(logits, ctx.maps)  # the model's scaling after its head
                if ctx.softcap is not None:
                    logits = torch.tanh(logits / ctx.softcap) * ctx.softcap
            grad_logits = _logits_grad(logits.detach(), targets[start:end], grad_logps[start:end], ctx.temperature)
            inputs = [x for x, need in ((h_leaf, need_h), (w_leaf, need_w), (b_leaf, need_b)) if need]
            grads = list(torch.autograd.grad(logits, inputs, grad_outputs=grad_logits, allow_unused=True))
            del logits, grad_logits
            if need_h:
                grad_h[start:end] = grads.pop(0)
            if need_w:
                grads.pop(0)  # None: the sink wrote the weight gradient into `sums`
            if need_b:
                g = grads.pop(0)
                grad_b = _acc(g) if grad_b is None else grad_b.add_(g)
        out_w = None if sums is None else sums.grads()[0]  # rounded to the weight's dtype once
        out_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, out_w, out_b, None, None, None, None, None, None


def chunked_token_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None = None, *, targets: Tensor, chunk_size: int,
    temperature: float = 1.0, final_logit_softcapping: float | None = None, stats: tuple = (),
    ignore_index: int = -100, logit_maps: tuple = (),
) -> tuple[Tensor, Tensor]:
    """Per-token log-probabilities of `targets` under `softcap(maps(hidden @ weight.T + bias)) / temperature`
    (`logit_maps`: the model's scaling after its head, `integrations/logit_maps.py`).

    Shapes: `hidden` [B, S, Hd], `weight` [V, Hd] (may be tied to the input embedding), `bias`
    [V] or None, `targets` [B, S] (the pre-shifted labels; `ignore_index` positions are scored
    as token 0, for the caller to mask). Returns fp32 `logps` [B, S] (differentiable in hidden,
    weight, bias) and fp32 `extra` [B, S, len(stats)] without gradient, `stats` a tuple of
    names from STATS: "entropy" (of the temperature-scaled distribution), "mean_logit" (its
    mean over the vocabulary), "is_top1" (1.0 where the target is the argmax). `chunk_size`
    counts rows of the flattened B·S; at most one chunk of [chunk_size, V] logits exists at any
    time, in forward and in backward. Not twice differentiable."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got chunk_size={chunk_size}")
    if hidden.dim() != 3 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"hidden must be [B, S, Hd] and weight [V, Hd], got hidden {tuple(hidden.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V] with V={weight.shape[0]}, got bias shape={tuple(bias.shape)}")
    if tuple(targets.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"targets shape={tuple(targets.shape)} must equal hidden [B, S]={tuple(hidden.shape[:2])}")
    if not temperature > 0 or (final_logit_softcapping is not None and not final_logit_softcapping > 0):
        raise ValueError(f"temperature and final_logit_softcapping must be > 0 (softcap None: off), got "
                         f"temperature={temperature!r}, final_logit_softcapping={final_logit_softcapping!r}")
    unknown = [s for s in stats if s not in STATS]
    if unknown or len(set(stats)) != len(stats):
        raise ValueError(f"stats must be distinct names from {STATS}, got {stats!r}")
    b, s = hidden.shape[:2]
    flat = hidden.reshape(b * s, hidden.shape[-1])  # [B, S, Hd] -> [B·S, Hd]
    t = targets.reshape(-1).to(hidden.device).masked_fill(targets.reshape(-1) == ignore_index, 0)  # [B·S]
    logps, extra = _ChunkedTokenLogprobs.apply(flat, weight, bias, t.long(), chunk_size, float(temperature),
                                               final_logit_softcapping, tuple(stats), tuple(logit_maps))
    return logps.view(b, s), extra.view(b, s, len(stats))  # [B·S] -> [B, S]; [B·S, k] -> [B, S, k]
