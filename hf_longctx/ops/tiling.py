"""Sequence tiling of the token-wise tail of a transformer: chunked MLP and chunked LM head + loss.

Where it sits: inside ``model(**shard)`` every decoder layer's MLP is routed through
:func:`chunked_mlp`, and the causal-LM loss on the local shard (pre-shifted labels, global
``num_items_in_batch``, DESIGN invariant 6) is computed by :func:`chunked_causal_lm_loss`
from the final hidden states, never from a full ``[B, S, V]`` logits tensor.
FPDT's chunked FFN and chunked loss: both are token-wise, so chunks recomputed in backward
give the same math per token with one chunk of ``[B, S, I]`` / ``[B, S, V]`` alive at a time.
Not supported: dropout inside the MLP (a recomputed chunk would need its first run's RNG
stream); the integration that patches MLPs refuses it."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# Attribute set on an input gradient its maker hands over whole (a row-chunked norm's or
# layer's): the next chunked consumer may rewrite it in place instead of copying it.
OWNED_GRAD = "_hf_longctx_owned_grad"

# The floor only guards against degenerate chunks (a 64-wide toy model with a 32K vocabulary
# would get ~4000 chunks of a few tokens). At 256 rows the per-chunk [256, Hd] x [Hd, V] GEMM
# is already 2·256·Hd·V FLOPs (over 1 GFLOP for Hd = 64, V = 32K), far above the per-chunk
# loop overhead of tens of microseconds, and one fp32 chunk of a 128K vocabulary is 128 MiB.
# A higher floor would override the sizing rule (`default_loss_chunk_size`) for mid-sized
# models and make the loss the memory peak again.
# Read-only constant, not a flag.
MIN_LOSS_CHUNK_TOKENS = 256


# Rows per MLP chunk the "auto" setting never goes below: a [1024, Hd] x [Hd, I] GEMM keeps a GPU
# busy, and below it the per-chunk launch overhead shows. Read-only constant, not a flag.
MIN_MLP_CHUNK_TOKENS = 1024


def default_mlp_chunks(fpdt_chunks: int, intermediate: int | None = None, hidden: int | None = None) -> int:
    """Number of sequence chunks for the MLP given FPDT's attention chunk count (and, when
    given, the model's intermediate and hidden sizes).

    FPDT chunks the MLP twice as finely as attention: the MLP intermediate ``[B, S, I]`` with
    I ~ 3.5 Hd (and two or three such tensors for gated MLPs) is larger per token than the
    attention chunk's q/k/v, so halving the chunk keeps the MLP's transient peak at or below the
    attention chunk's. With the sizes, also at least ceil(4·I / Hd): a chunk's backward holds
    about four I-wide tensors per token (gate, up, activation, their product), which then take
    no more than the hidden states of the whole sequence -- without FPDT (2 chunks) they would
    be 7 hidden-size vectors per token for a Llama. Always at least 1.
    """
    if fpdt_chunks < 1:
        raise ValueError(f"fpdt_chunks must be >= 1, got fpdt_chunks={fpdt_chunks}")
    if intermediate and hidden:
        return max(2 * fpdt_chunks, math.ceil(4 * intermediate / hidden))
    return 2 * fpdt_chunks


def mlp_chunks_at(chunks: int, rows: int, auto: bool) -> int:
    """Chunks for `rows` tokens: `chunks`, and with the "auto" setting no chunk below
    MIN_MLP_CHUNK_TOKENS rows (a shorter sequence is one chunk)."""
    if not auto:
        return max(1, min(chunks, rows))
    return max(1, min(chunks, rows // MIN_MLP_CHUNK_TOKENS))


def default_loss_chunk_size(config: Any, seq_len: int) -> int:
    """Tokens per loss chunk for a call over ``seq_len`` tokens (``B * S`` of the local shard).

    About ``8 * V / Hd`` chunks. Why that number: a chunk's loss holds three fp32 ``[chunk, V]``
    tensors (log-softmax output, its gradient, the logits' gradient) and one in the compute
    dtype; at ``8 V / Hd`` chunks one fp32 chunk holds ``seq_len * Hd / 2`` bytes, a quarter of
    the bf16 hidden states of the sequence, so the loss's transient stays under one hidden-size
    vector per token. FPDT splits into ``2 V / Hd`` chunks (one fp32 chunk = the bf16 hidden
    states): about 3.5 vectors per token, which would make the loss the memory peak of a step
    whose layers keep about three (memory="max"). The GEMMs stay large (Llama-3.1-8B at 1M
    tokens: 251 chunks of 4,178 rows). A floor of :data:`MIN_LOSS_CHUNK_TOKENS` (256) tokens per
    chunk keeps tiny models (V / Hd can be 500+ for a 64-wide toy) from degenerating into many
    few-token GEMMs; a sequence shorter than the floor is one chunk.

    ``config`` is a transformers ``PretrainedConfig`` (multimodal configs are reduced to their
    text config); it must expose ``vocab_size`` and ``hidden_size``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got seq_len={seq_len}")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab_size = getattr(text_config, "vocab_size", None)
    hidden_size = getattr(text_config, "hidden_size", None)
    if not vocab_size or not hidden_size:
        raise ValueError(
            f"config needs vocab_size and hidden_size, got vocab_size={vocab_size}, hidden_size={hidden_size}"
        )
    num_chunks = max(1, math.ceil(8 * vocab_size / hidden_size))
    chunk_size = max(math.ceil(seq_len / num_chunks), MIN_LOSS_CHUNK_TOKENS)
    return min(chunk_size, seq_len)


def chunked_mlp(forward: Callable[[Tensor], Tensor], hidden: Tensor, chunks: int) -> Tensor:
    """Apply a token-wise MLP ``forward`` to ``hidden`` ``[B, S, Hd]`` in ``chunks`` sequence chunks.

    ``forward`` is the MLP module's original bound forward (gate/up/down, fused gate_up, fc/proj
    or Conv1D c_fc/c_proj all work: only token-wise behaviour is assumed). Each chunk runs under
    non-reentrant activation checkpointing, so forward keeps only the chunk's input (a view of
    ``hidden``) and backward recomputes one chunk at a time: autograd walks the chunks in reverse
    creation order and frees each chunk's recomputed intermediates before starting the next.
    Non-reentrant checkpointing (rather than a hand-written Function that calls ``.backward``
    internally) keeps ``torch.autograd.grad`` and FSDP2's gradient hooks working on the MLP's
    parameters. Uneven splits are fine (chunk lengths differ by at most one token); more chunks
    than tokens collapse to one token per chunk. Dropout is not supported (see module docstring).
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got chunks={chunks}")
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, S, Hd], got shape={tuple(hidden.shape)}")
    seq_len = hidden.shape[1]
    chunks = min(chunks, seq_len)
    if chunks <= 1:
        return forward(hidden)

    def run_chunk(piece: Tensor) -> Tensor:
        # A sequence slice of a B > 1 batch is strided; GPT-2's Conv1D calls .view() on its
        # input, so hand every MLP a contiguous chunk. Done inside the checkpointed region so
        # the copy is recomputed in backward instead of being kept alive.
        return forward(piece.contiguous())

    pieces = torch.tensor_split(hidden, chunks, dim=1)  # chunks x [B, S_c, Hd], views
    if not torch.is_grad_enabled():
        # Inference: nothing to recompute, but the intermediate peak still shrinks per chunk.
        return torch.cat([run_chunk(p) for p in pieces], dim=1)  # [B, S, Hd]
    outs = [checkpoint(run_chunk, p, use_reentrant=False) for p in pieces]  # chunks x [B, S_c, Hd]
    return torch.cat(outs, dim=1)  # [B, S, Hd]


class _Tokenwise(torch.autograd.Function):
    """A token-wise module over row chunks as one autograd node: forward per chunk without a
    graph, backward per chunk (recompute, then its gradient) into one input-gradient buffer;
    the parameters' chunk gradients are summed in fp32 and rounded once."""

    @staticmethod
    def forward(ctx: Any, forward: Callable, chunks: int, hidden: Tensor, *params: Tensor) -> Tensor:  # type: ignore[override]
        ctx.forward, ctx.chunks, ctx.params = forward, chunks, params
        ctx.autocast = {"enabled": torch.is_autocast_enabled(hidden.device.type),
                        "dtype": torch.get_autocast_dtype(hidden.device.type)}
        ctx.save_for_backward(hidden)
        return torch.cat([forward(p.contiguous()) for p in torch.tensor_split(hidden, chunks, dim=1)], dim=1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        (hidden,) = ctx.saved_tensors
        need_h, needs = ctx.needs_input_grad[2], ctx.needs_input_grad[3:]
        params = [p for p, n in zip(ctx.params, needs) if n]
        dh = torch.empty_like(hidden) if need_h else None  # [B, S, Hd], filled row chunk by row chunk
        sums: list[Tensor | None] = [None] * len(params)
        lo = 0
        for piece in torch.tensor_split(hidden, ctx.chunks, dim=1):
            hi = lo + piece.shape[1]
            with torch.enable_grad(), torch.autocast(hidden.device.type, **ctx.autocast):
                x = piece.detach().contiguous().requires_grad_(need_h)
                y = ctx.forward(x)
                wrt = ([x] if need_h else []) + params
                grads = list(torch.autograd.grad(y, wrt, grad[:, lo:hi], allow_unused=True)) if wrt else []
            if need_h:
                dh[:, lo:hi] = grads.pop(0)
            for i, g in enumerate(grads):
                if g is not None:
                    sums[i] = g.float() if sums[i] is None else sums[i].add_(g)
            lo = hi
        it = iter(sums)
        out = [(next(it) if n else None) for n in needs]
        out = [None if g is None else g.to(p.dtype) for g, p in zip(out, ctx.params)]
        if dh is not None:
            setattr(dh, OWNED_GRAD, True)  # only the module before reads it
        return (None, None, dh, *out)


def tokenwise_chunks(forward: Callable[[Tensor], Tensor], hidden: Tensor, chunks: int, params: list) -> Tensor:
    """`forward` (a token-wise module, e.g. the final norm: `params` are its parameters) over
    ``hidden`` ``[B, S, Hd]`` in ``chunks`` row chunks, forward and backward: only one chunk's
    intermediates (e.g. a norm's fp32 copies) exist at a time, the input is saved, and the
    input gradient is one buffer written chunk by chunk (no per-chunk full-size gradients).
    Without gradients it is the plain chunked loop."""
    chunks = max(1, min(chunks, hidden.shape[1]))
    if not torch.is_grad_enabled() or not (hidden.requires_grad or any(p.requires_grad for p in params)):
        return torch.cat([forward(p.contiguous()) for p in torch.tensor_split(hidden, chunks, dim=1)], dim=1)
    return _Tokenwise.apply(forward, chunks, hidden, *params)


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None) -> Tensor:
    """Logits of one chunk exactly as the HF model computes them: lm_head in the hidden dtype,
    Gemma2's softcap in that dtype too, then the upcast ForCausalLMLoss applies."""
    logits = F.linear(h, weight, bias)  # [n, V]
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

        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None  # [B*S, Hd]
        # Accumulating per-chunk weight grads in a low-precision dtype would add one rounding per
        # chunk; an fp32 accumulator keeps the sum as accurate as the single unchunked GEMM.
        grad_w: Tensor | None = None
        grad_b: Tensor | None = None
        w_leaf = weight.detach().requires_grad_(need_w)
        b_leaf = bias.detach().requires_grad_(bool(need_b)) if bias is not None else None
        for start in range(0, n_tokens, chunk_size):
            end = min(start + chunk_size, n_tokens)
            h_leaf = hidden[start:end].detach().requires_grad_(need_h)  # [n, Hd]
            with torch.enable_grad():
                logits = _chunk_logits(h_leaf, w_leaf, b_leaf, softcap)  # [n, V] fp32
                ce_sum = F.cross_entropy(logits, labels[start:end], ignore_index=ignore_index, reduction="sum")
                del logits  # the autograd graph keeps what it needs; drop our reference early
                if not need_any:
                    loss_sum += ce_sum.detach()
                    continue
                inputs = [t for t, need in ((h_leaf, need_h), (w_leaf, need_w), (b_leaf, need_b)) if need]
                grads = list(torch.autograd.grad(ce_sum / denominator, inputs))
            loss_sum += ce_sum.detach()
            if need_h:
                grad_h[start:end] = grads.pop(0)
            if need_w:
                g = grads.pop(0)
                grad_w = g.float() if grad_w is None else grad_w.add_(g)
            if need_b and bias is not None:
                g = grads.pop(0)
                grad_b = g.float() if grad_b is None else grad_b.add_(g)
        loss = loss_sum / denominator
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
        return out_h, out_w, out_b, None, None, None, None, None


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
    summation order. Not twice differentiable.
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
    )
