"""Chunked LM head + causal-LM loss from the final hidden states, never a full ``[B, S, V]`` logits tensor.

Where it sits: at the end of ``model(**shard)`` the patched LM head (``integrations/memory.py``)
calls :func:`chunked_causal_lm_loss` on the local shard's final hidden states with the
pre-shifted labels and the global ``num_items_in_batch`` (DESIGN invariant 6), in chunks of
``ops/loss_rows.loss_chunk_rows`` tokens. FPDT's chunked loss (§3.5): cross-entropy is
token-wise, so each chunk's loss and gradients are the unchunked model's per token.
Guarantees: ForCausalLMLoss's numerics (softcap, autocast, dtype rounding per token); at most
one chunk of ``[chunk, V]`` logits alive, forward and backward; gradients taken in forward,
so the backward needs no weights."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hf_longctx.ops.grad_sums import GradSums, sink_linear


def mapped(logits: Tensor, maps: tuple = ()) -> Tensor:
    """`logits` through the model's maps after its head (("*" or "/", value), ...:
    `integrations/logit_maps.py`), the same op in the same dtype as its forward runs them."""
    for op, value in maps:
        logits = logits * value if op == "*" else logits / value
    return logits


def chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None,
                 sums: GradSums | None = None, maps: tuple = ()) -> Tensor:
    """Logits of one chunk exactly as the HF model computes them: lm_head in the hidden dtype,
    the model's scaling after it (`maps`) and Gemma2's softcap in that dtype too, then the upcast
    ForCausalLMLoss applies. With `sums` the weight gradient of the chunk goes into its fp32 sum
    (one GEMM, `ops/grad_sums.py`)."""
    logits = F.linear(h, weight, bias) if sums is None else sink_linear(h, weight, bias, sums, 0)  # [n, V]
    logits = mapped(logits, maps)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits.float()


class _ChunkedLMHeadLoss(torch.autograd.Function):
    """Loss and all gradients computed chunk by chunk in forward.

    Gradients are produced in forward (one LM-head GEMM fewer than recomputing in backward, and
    the LM-head weight is not needed again in backward, which suits FSDP resharding). Each chunk's
    gradient is taken by autograd over the same ops the unchunked model runs, so softcap,
    autocast and dtype rounding match the reference per token. What is saved for backward is
    hidden-sized (grad of hidden) and weight-sized (grad of weight), never logits-sized.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        denominator: Tensor | float | None,
        chunk_size: int,
        softcap: float | None,
        ignore_index: int,
        tail: Any = None,
        maps: tuple = (),
    ) -> Tensor:
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_any = need_h or need_w or bool(need_b and bias is not None)
        n_tokens = hidden.shape[0]
        if denominator is None:
            # ForCausalLMLoss's "mean" reduction divides by the number of non-ignored labels
            # (0 valid labels gives nan there too).
            denominator = (labels != ignore_index).sum().to(torch.float32)
        elif torch.is_tensor(denominator):
            denominator = denominator.to(hidden.device)

        if tail is not None:
            return _fused_chunks(ctx, hidden, weight, bias, labels, denominator, chunk_size, softcap, ignore_index, tail,
                                 maps)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None  # [B*S, Hd]
        # Accumulating per-chunk weight grads in a low-precision dtype would add one rounding per
        # chunk; an fp32 sum, which each chunk's weight-gradient GEMM writes into, keeps the sum
        # as accurate as the single unchunked GEMM without a weight-sized gradient per chunk.
        sums = GradSums([weight]) if need_w else None
        grad_b: Tensor | None = None
        w_leaf = weight.detach().requires_grad_(need_w)
        b_leaf = bias.detach().requires_grad_(bool(need_b)) if bias is not None else None
        for start in range(0, n_tokens, chunk_size):
            end = min(start + chunk_size, n_tokens)
            h_leaf = hidden[start:end].detach().requires_grad_(need_h)  # [n, Hd]
            with torch.enable_grad():
                logits = chunk_logits(h_leaf, w_leaf, b_leaf, softcap, sums, maps)  # [n, V] fp32
                ce_sum = F.cross_entropy(logits, labels[start:end], ignore_index=ignore_index, reduction="sum")
                del logits  # the autograd graph keeps what it needs; drop our reference early
                if not need_any:
                    loss_sum += ce_sum.detach()
                    continue
                inputs = [t for t, need in ((h_leaf, need_h), (w_leaf, need_w), (b_leaf, need_b)) if need]
                grads = list(torch.autograd.grad(ce_sum / denominator, inputs, allow_unused=True))
            loss_sum += ce_sum.detach()
            if need_h:
                grad_h[start:end] = grads.pop(0)
            if need_w:
                grads.pop(0)  # None: the sink wrote the weight gradient into `sums`
            if need_b and bias is not None:
                g = grads.pop(0)
                grad_b = g.float() if grad_b is None else grad_b.add_(g)
        loss = loss_sum / denominator
        grad_w = sums.grads(rounded=False)[0] if sums is not None else None  # fp32 until scaled in backward
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        grad_h, grad_w, grad_b = ctx.saved_tensors
        # The gradients were taken for d(loss) = 1; the loss is linear in its scale, so the
        # upstream gradient (1 in plain training) just multiplies them.
        out_h = None if grad_h is None else grad_h * grad_out.to(grad_h.dtype)
        out_w = None if grad_w is None else (grad_w * grad_out).to(ctx.weight_dtype)
        out_b = None if grad_b is None else (grad_b * grad_out).to(ctx.bias_dtype)
        return out_h, out_w, out_b, None, None, None, None, None, None, None


def _fused_chunks(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, denominator: Tensor,
                  chunk_size: int, softcap: float | None, ignore_index: int, tail: Any, maps: tuple = ()) -> Tensor:
    """`_ChunkedLMHeadLoss.forward` with the loss's elementwise tail fused (`ops/fused.
    cross_entropy_tail`, compiled by `integrations/fusion.py`): per chunk the logits GEMM, one
    fused pass for the loss and the logits' gradient, then the two gradient GEMMs -- the input's
    into its rows, the weight's into its fp32 sum (`GradSums.addmm`). The operands are those of
    the autograd path: under autocast the hidden rows and the weight (cast once) in the compute
    dtype. The model's scaling after its head (`maps`) maps the logits before the tail and its
    gradient after it (the chain rule through each scalar)."""
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = bool(need_b and bias is not None)
    kind = hidden.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    with torch.no_grad(), torch.autocast(kind, enabled=False):
        w = weight.detach() if dtype is None else weight.detach().to(dtype)  # [V, Hd]
        b = None if bias is None else bias.detach() if dtype is None else bias.detach().to(dtype)  # [V]
        # 1 / the denominator, what autograd hands the eager path's ce_sum / den: one kernel, never
        # a copy of Python data to the device (a host sync there)
        scale = (1.0 / denominator if torch.is_tensor(denominator) else  # [] fp32
                 torch.full((), 1.0 / denominator, dtype=torch.float32, device=hidden.device))
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None  # [B*S, Hd]
        sums = GradSums([weight]) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None  # [V]
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:end] if dtype is None else hidden[start:end].to(dtype)  # [n, Hd]
            ce_sum, dz = tail(mapped(F.linear(h, w, b), maps), labels[start:end], scale, softcap, ignore_index)  # [], [n, V]
            dz = mapped(dz, maps)  # d/dz of z * c is c, of z / c is 1 / c: the same maps
            loss_sum += ce_sum
            if need_h:
                grad_h[start:end] = dz @ w  # [n, V] @ [V, Hd]
            if need_w:
                sums.addmm(0, dz.t(), h)  # [V, n] @ [n, Hd] into the fp32 sum
            if need_b:
                grad_b += dz.sum(0, dtype=torch.float32)
    ctx.weight_dtype = weight.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(grad_h, None if sums is None else sums.grads(rounded=False)[0], grad_b)
    return loss_sum / denominator


def chunked_causal_lm_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    shift_labels: Tensor,
    num_items_in_batch: int | Tensor | None = None,
    chunk_size: int,
    final_logit_softcapping: float | None = None,
    ignore_index: int = -100,
    tail: Any = None,
    logit_maps: tuple = (),
) -> Tensor:
    """Causal-LM loss from final hidden states without materialising full logits.

    Same numerics as ``transformers.loss.loss_utils.ForCausalLMLoss(logits, labels=None,
    vocab_size=V, num_items_in_batch=..., shift_labels=...)`` applied to
    ``logits = lm_head(hidden)`` (softcapped as Gemma2 does when ``final_logit_softcapping``
    is set): sum of token cross-entropies / ``num_items_in_batch``, or the mean over
    non-ignored tokens when it is None.

    Shapes: ``hidden`` ``[B, S, Hd]``, ``weight`` ``[V, Hd]`` (may be tied to the input
    embedding), ``bias`` ``[V]``, ``shift_labels`` ``[B, S]`` already shifted (the label at
    position t is the target of position t; ``ignore_index`` is skipped). ``chunk_size`` counts
    tokens of the flattened ``B * S``; at most one chunk of ``[chunk_size, V]`` logits exists at
    any time, in forward and in backward. Gradients for hidden, weight and bias are exact up to
    summation order. Not twice differentiable. ``tail``: the compiled ``ops/fused.
    cross_entropy_tail`` (``patch(fused=True)``), which computes each chunk's loss and logits
    gradient in one fused pass; None: autograd over the eager ops. ``logit_maps``: what the
    model does to its head's logits before the loss (``integrations/logit_maps.py``), applied to
    each chunk's logits before the softcap.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got chunk_size={chunk_size}")
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, S, Hd], got shape={tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, Hd] with Hd={hidden.shape[-1]}, got weight shape={tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V] with V={weight.shape[0]}, got bias shape={tuple(bias.shape)}")
    if tuple(shift_labels.shape) != tuple(hidden.shape[:2]):
        raise ValueError(
            f"shift_labels shape={tuple(shift_labels.shape)} must equal hidden [B, S]={tuple(hidden.shape[:2])}"
        )
    if final_logit_softcapping is not None and final_logit_softcapping <= 0:
        raise ValueError(f"final_logit_softcapping must be > 0 or None, got {final_logit_softcapping}")
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])  # [B, S, Hd] -> [B*S, Hd]
    labels_1d = shift_labels.reshape(-1).to(hidden.device)  # [B, S] -> [B*S]
    return _ChunkedLMHeadLoss.apply(
        hidden_2d,
        weight,
        bias,
        labels_1d,
        num_items_in_batch,
        chunk_size,
        final_logit_softcapping,
        ignore_index,
        tail,
        tuple(logit_maps),
    )
