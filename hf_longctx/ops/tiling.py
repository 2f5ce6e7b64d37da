"""Sequence tiling of the token-wise tail of a transformer: the chunk counts, the chunked MLP and norms.

Where it sits: inside ``model(**shard)`` every decoder layer's MLP is routed through
:func:`chunked_mlp`, and its norms and the final norm through :func:`tokenwise_chunks`; the
sizing rules here (:func:`default_mlp_chunks`, :func:`mlp_chunks_at`) set the MLP's chunks
(the loss's: ``ops/loss_rows.py``), and ``capacity/`` reads them too. FPDT's chunked FFN
(§3.5): token-wise, so chunks recomputed in backward give the same math per token with one
chunk of ``[B, S, I]`` alive at a time.
Not supported: dropout inside the MLP (a recomputed chunk would need its first run's RNG
stream); the integration that patches MLPs refuses it."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from hf_longctx.ops.grad_sums import GradSums, SumsSlot

# Attribute set on an input gradient its maker hands over whole (a row-chunked norm's or
# layer's): the next chunked consumer may rewrite it in place instead of copying it.
OWNED_GRAD = "_hf_longctx_owned_grad"

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


def chunked_mlp(forward: Callable[[Tensor], Tensor], hidden: Tensor, chunks: int, params: list | None = None,
                slot: SumsSlot | None = None) -> Tensor:
    """Apply a token-wise MLP ``forward`` to ``hidden`` ``[B, S, Hd]`` in ``chunks`` sequence chunks.

    ``forward`` is the MLP module's original bound forward (gate/up/down, fused gate_up, fc/proj
    or Conv1D c_fc/c_proj all work: only token-wise behaviour is assumed). Forward keeps only
    ``hidden``; backward recomputes one chunk at a time right before its gradient
    (:func:`tokenwise_chunks`), so one chunk's intermediates are alive at a time. The parameters
    (``params``, else those of the module ``forward`` is bound to) get their gradients returned
    from that one node, so ``torch.autograd.grad`` and FSDP2's gradient hooks see them; with the
    patch's ``slot`` the MLP's projections add their chunk weight gradients into one fp32 sum per
    weight in place (``ops/grad_sums.py``). A ``forward`` with no module behind it runs under
    non-reentrant activation checkpointing per chunk. Uneven splits are fine (chunk lengths differ
    by at most one token); more chunks than tokens collapse to one token per chunk. Dropout is not
    supported (see module docstring). A ``forward`` returning a tuple (a MoE MLP's hidden states
    and router scores, GPT-OSS) is chunked on its first output and returns its other outputs
    joined over the chunks, as the unchunked call does (`_joined`; no gradient flows into them).
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got chunks={chunks}")
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, S, Hd], got shape={tuple(hidden.shape)}")
    seq_len = hidden.shape[1]
    chunks = min(chunks, seq_len)
    if chunks <= 1:
        return forward(hidden)
    parts: list = []  # the forward's chunks' further outputs (a MoE MLP's router scores: GPT-OSS)

    def main(x: Tensor) -> Tensor:
        out = forward(x)
        if not isinstance(out, tuple):
            return out
        if len(parts) < chunks:  # the forward's calls come first; a backward's recomputes add nothing
            parts.append(out[1:])
        return out[0]

    out = _chunked_main(main, getattr(forward, "__self__", None), hidden, chunks, params, slot)
    if not parts:
        return out
    sizes = [p.shape[1] for p in torch.tensor_split(hidden, chunks, dim=1)]
    return (out, *_joined(parts, hidden.shape[0], sizes))


def _joined(parts: list, batch: int, sizes: list[int]) -> tuple:
    """Each further output of an MLP's chunk calls, joined over the chunks as the unchunked call
    returns it: [B, S_c, ...] along the tokens, [B·S_c, ...] (tokens flattened batch-major)
    likewise; anything else (None) as the last chunk's. Raises naming an output not per token."""
    joined = []
    for k, group in enumerate(zip(*parts)):
        if not all(isinstance(t, Tensor) for t in group):
            joined.append(group[-1])
        elif all(t.shape[:2] == (batch, n) for t, n in zip(group, sizes)):
            joined.append(torch.cat(group, dim=1))  # chunks x [B, S_c, ...] -> [B, S, ...]
        elif all(t.dim() >= 1 and t.shape[0] == batch * n for t, n in zip(group, sizes)):
            rows = [t.reshape(batch, n, *t.shape[1:]) for t, n in zip(group, sizes)]  # [B·S_c, ...] -> [B, S_c, ...]
            joined.append(torch.cat(rows, dim=1).reshape(batch * sum(sizes), *group[0].shape[1:]))  # -> [B·S, ...]
        else:
            raise ValueError(f"mlp_chunks: the MLP's output {k + 2} is {tuple(group[0].shape)} for a chunk of "
                             f"{sizes[0]} tokens (batch {batch}), not per token; patch without mlp_chunks")
    return tuple(joined)


def _chunked_main(forward: Callable[[Tensor], Tensor], owner: Any, hidden: Tensor, chunks: int, params: list | None,
                  slot: SumsSlot | None) -> Tensor:
    """`chunked_mlp` of a `forward` that returns one tensor; `owner`: the module it is bound to."""
    if params is None and isinstance(owner, torch.nn.Module):
        params = [p for p in owner.parameters() if p.requires_grad]
    if params is not None:
        return tokenwise_chunks(forward, hidden, chunks, params, slot)

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
    the parameters' chunk gradients go into one fp32 sum each (`ops/grad_sums.GradSums`, bound
    to `slot` so the module's projections write their weight gradients into it), rounded once."""

    @staticmethod
    def forward(ctx: Any, forward: Callable, chunks: int, slot: SumsSlot | None, hidden: Tensor,  # type: ignore[override]
                *params: Tensor) -> Tensor:
        ctx.forward, ctx.chunks, ctx.slot, ctx.params = forward, chunks, slot, params
        ctx.autocast = {"enabled": torch.is_autocast_enabled(hidden.device.type),
                        "dtype": torch.get_autocast_dtype(hidden.device.type)}
        ctx.save_for_backward(hidden)
        # Detached: a row view taken here (grad off) of a tensor that requires grad would claim
        # requires_grad without a grad_fn, which hooks on a sub-module's inputs (ModTracker) cannot follow.
        pieces = torch.tensor_split(hidden.detach(), chunks, dim=1)  # chunks x [B, S_c, Hd]
        return torch.cat([forward(p.contiguous()) for p in pieces], dim=1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        (hidden,) = ctx.saved_tensors
        need_h, needs = ctx.needs_input_grad[3], ctx.needs_input_grad[4:]
        sums = GradSums(ctx.params, needs)
        params = [p for p, n in zip(ctx.params, needs) if n]
        idx = [i for i, n in enumerate(needs) if n]
        dh = torch.empty_like(hidden) if need_h else None  # [B, S, Hd], filled row chunk by row chunk
        lo = 0
        with ctx.slot.bound(sums) if ctx.slot is not None else nullcontext():
            for piece in torch.tensor_split(hidden, ctx.chunks, dim=1):
                hi = lo + piece.shape[1]
                with torch.enable_grad(), torch.autocast(hidden.device.type, **ctx.autocast):
                    x = piece.detach().contiguous().requires_grad_(need_h)
                    y = ctx.forward(x)
                    wrt = ([x] if need_h else []) + params
                    grads = list(torch.autograd.grad(y, wrt, grad[:, lo:hi], allow_unused=True)) if wrt else []
                if need_h:
                    dh[:, lo:hi] = grads.pop(0)
                for i, g in zip(idx, grads):
                    if g is not None:
                        sums.add(i, g)
                lo = hi
        if dh is not None:
            setattr(dh, OWNED_GRAD, True)  # only the module before reads it
        return (None, None, None, dh, *sums.grads())


def tokenwise_chunks(forward: Callable[[Tensor], Tensor], hidden: Tensor, chunks: int, params: list,
                     slot: SumsSlot | None = None) -> Tensor:
    """`forward` (a token-wise module, e.g. the final norm: `params` are its parameters) over
    ``hidden`` ``[B, S, Hd]`` in ``chunks`` row chunks, forward and backward: only one chunk's
    intermediates (e.g. a norm's fp32 copies) exist at a time, the input is saved, and the
    input gradient is one buffer written chunk by chunk (no per-chunk full-size gradients).
    `slot`: the patch's `SumsSlot`, bound to the backward's gradient sums (the module's
    projections write into them). Without gradients it is the plain chunked loop."""
    chunks = max(1, min(chunks, hidden.shape[1]))
    if not torch.is_grad_enabled() or not (hidden.requires_grad or any(p.requires_grad for p in params)):
        return torch.cat([forward(p.contiguous()) for p in torch.tensor_split(hidden, chunks, dim=1)], dim=1)
    return _Tokenwise.apply(forward, chunks, slot, hidden, *params)
