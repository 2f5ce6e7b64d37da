"""Decode attention over one rank's share of a sequence-parallel KV cache: the split-KV partial.

Where it sits: a decode step of `hf_longctx.generation` (prefill, then one token per row per
step) calls it once per attention layer through `integrations/generation_binding.py`. Every rank
of the SP group holds the K/V of its own tokens of every row (`ops/decode_cache.py`); the new
tokens' queries, identical on every rank, attend that share here, and `ops/decode_merge.py` folds
the ranks' partials with THE log-sum-exp merge (`ops/lse.py`). This is flash-decoding's split-KV
(Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference": keys split into
blocks, each block's (out, lse) computed alone, then merged) with the blocks spread over the SP
group as decode context parallelism does across GPUs, and within a rank over key chunks.
Guarantees: exact softmax attention with fp32 scores, out and lse; causal by global position
(a key is seen iff its position <= the query's), sliding windows (i - j < window) and softcaps as
the training path; GQA by HF's rule (query head h reads KV head h // (H / H_kv)); a row with no
key gives out 0 and lse -inf (the merge identity); no host read: the chunk bounds are host ints,
every index a device tensor. The key-visibility masks depend on the step's query positions, the
cache's slots, the valid count and the window, not on the layer: `visibility_masks` builds them,
and a caller running many layers of one step (the binding: once per step and window) hands them to
every layer's `decode_partial`; without them `decode_partial` builds its own, the same masks."""

from __future__ import annotations

import torch

from hf_longctx.ops.lse import merge_

# Key slots per chunk: the chunk's gathered queries and weighted values are [C, H, D] fp32 each
# (4096 x 32 heads x 128 x 4 B = 64 MiB at Llama-3-8B's shape): a bounded working set at any length.
DEFAULT_CHUNK = 4096


def check_decode_inputs(q, keys, values, key_rows, key_pos, query_pos, filled: int) -> None:
    """ValueError naming the shapes unless q [N, H, D], keys/values [T, H_kv, D] with H % H_kv == 0,
    key_rows/key_pos [T], query_pos [N] and 0 <= filled <= T."""
    if q.dim() != 3 or keys.dim() != 3 or keys.shape != values.shape:
        raise ValueError(f"decode attention needs q [N, H, D] and keys/values [T, H_kv, D] of one shape, got q "
                         f"{tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}")
    n, h, d = q.shape
    t, h_kv, d_k = keys.shape
    if d_k != d or h_kv < 1 or h % h_kv:
        raise ValueError(f"q [N={n}, H={h}, D={d}] and keys [T={t}, H_kv={h_kv}, D={d_k}]: D must agree and H be a "
                         "multiple of H_kv")
    if key_rows.shape != (t,) or key_pos.shape != (t,) or query_pos.shape != (n,):
        raise ValueError(f"key_rows and key_pos must be [T={t}] and query_pos [N={n}], got {tuple(key_rows.shape)}, "
                         f"{tuple(key_pos.shape)}, {tuple(query_pos.shape)}")
    if not 0 <= filled <= t:
        raise ValueError(f"filled = {filled} slots, but the cache has T = {t}")


def _chunks(filled: int, chunk: int) -> list[tuple[int, int]]:
    """The key chunks [a, b) of the valid slots [0, filled), in order: host ints."""
    step = max(1, chunk)
    return [(a, min(filled, a + step)) for a in range(0, filled, step)]


def visibility_masks(key_rows: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor, filled: int,
                     window: int | None, chunk: int = DEFAULT_CHUNK) -> list[torch.Tensor]:
    """The masked-out slots of every key chunk of `decode_partial` over [0, filled) in chunks of
    `chunk`: [C] bool each, in chunk order, True where the slot's key is hidden from its row's query
    (a later position, or `window` or more positions earlier). key_rows/key_pos [T] long, query_pos
    [N] long, on one device; no host read."""
    masks = []
    for a, b in _chunks(filled, chunk):
        gap = query_pos.index_select(0, key_rows[a:b]) - key_pos[a:b]  # [C]: query position minus key position
        masks.append(gap < 0 if window is None else (gap < 0) | (gap >= window))  # [C]: not (0 <= gap < window)
    return masks


def _chunk_partial(qf, keys, values, rows, hidden, *, scale, softcap):
    """(out [N, H, D], lse [N, H]) fp32 of every row over one chunk of C key slots.

    qf [N, H_kv, g, D] fp32; keys/values [C, H_kv, D]; rows [C] long; hidden [C] bool, the slots
    masked out (`visibility_masks`)."""
    n, h_kv, g, d = qf.shape
    c = keys.shape[0]
    qg = qf.index_select(0, rows)  # [C, H_kv, g, D]: each key slot meets its own row's query
    s = torch.matmul(qg, keys.float().unsqueeze(-1)).squeeze(-1)  # [C, H_kv, g]: one dot product per (slot, head)
    s = s * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap  # Gemma 2's logit softcap, as the training kernels apply it
    s = s.reshape(c, h_kv * g).masked_fill(hidden.unsqueeze(1), float("-inf"))  # [C, H]
    index = rows.unsqueeze(1).expand(c, h_kv * g)  # [C, H]
    # The segment max per (row, head): every row's exponentials are taken against its OWN maximum,
    # so a row whose scores are all far below another row's keeps its mass (no underflow to 0).
    m = torch.full((n, h_kv * g), float("-inf"), device=s.device).scatter_reduce_(0, index, s, "amax")  # [N, H]
    m = m.masked_fill(torch.isneginf(m), 0.0)  # a row with no key here: any finite reference, its weights are 0
    e = torch.exp(s - m.index_select(0, rows))  # [C, H]; masked slots exp(-inf) = 0
    den = torch.zeros_like(m).index_add_(0, rows, e)  # [N, H]
    ev = e.view(c, h_kv, g, 1) * values.float().unsqueeze(2)  # [C, H_kv, g, D]: weights times the slot's values
    num = torch.zeros(n, h_kv * g, d, device=s.device).index_add_(0, rows, ev.view(c, h_kv * g, d))  # [N, H, D]
    out = num / den.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)  # den 0 -> num 0 -> out 0
    lse = torch.where(den > 0, m + torch.log(den), torch.full_like(den, float("-inf")))  # [N, H]
    return out, lse


def _check_masks(masks: list[torch.Tensor], bounds: list[tuple[int, int]], filled: int, chunk: int) -> None:
    """ValueError naming the lengths unless `masks` has one [b - a] mask per chunk [a, b) of `bounds`
    (shapes only: no device read)."""
    if len(masks) != len(bounds):
        raise ValueError(f"{len(masks)} chunk masks for filled = {filled} slots in chunks of {chunk}, which make "
                         f"{len(bounds)} chunks: masks of another step or chunk size")
    for i, (m, (a, b)) in enumerate(zip(masks, bounds)):
        if tuple(m.shape) != (b - a,):
            raise ValueError(f"chunk mask {i} has shape {tuple(m.shape)}, but chunk {i} holds slots [{a}, {b}) "
                             f"= {b - a} of filled = {filled}: masks of another step or chunk size")


def decode_partial(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_rows: torch.Tensor, key_pos: torch.Tensor,
    query_pos: torch.Tensor, filled: int, *, scale: float, window: int | None = None, softcap: float | None = None,
    chunk: int = DEFAULT_CHUNK, masks: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial attention of one new token per row over its cache share.

    q [N, H, D] (the new tokens' queries, after RoPE); keys/values [T, H_kv, D] the cache slots,
    of which [0, filled) are valid (on q's device, or on the host: read chunk by chunk); key_rows
    [T] the row each slot belongs to; key_pos [T] its global position in that row; query_pos [N]
    each query's position. `masks`: None (built here from `window`), or `visibility_masks(key_rows,
    key_pos, query_pos, filled, window, chunk)` of these very arguments, built once for the layers of
    a step; `window` is then not read (the masks carry it), and a list whose count or shapes do not
    match the chunks is a ValueError. Returns out [N, H, D] and lse [N, H], float32 (merged over
    the rank's key chunks with `ops/lse.merge_`), for `ops/decode_merge.py` to fold over the SP
    group and round once."""
    check_decode_inputs(q, keys, values, key_rows, key_pos, query_pos, filled)
    bounds = _chunks(filled, chunk)
    if masks is None:
        masks = visibility_masks(key_rows, key_pos, query_pos, filled, window, chunk)
    else:
        _check_masks(masks, bounds, filled, chunk)
    n, h, d = q.shape
    h_kv = keys.shape[1]
    qf = q.float().view(n, h_kv, h // h_kv, d)  # [N, H_kv, g, D]: query head h -> KV head h // g
    out = lse = None
    for (a, b), hidden in zip(bounds, masks):
        k, v = keys[a:b], values[a:b]
        if k.device != q.device:  # a host-resident cache: this chunk to the device (pinned: no host wait)
            k, v = k.to(q.device, non_blocking=True), v.to(q.device, non_blocking=True)
        o, l = _chunk_partial(qf, k, v, key_rows[a:b], hidden, scale=scale, softcap=softcap)
        if out is None:
            out, lse = o, l
        else:
            merge_(out, lse, o, l)  # [N, H, D] / [N, H]: THE merge, in place into the first chunk's fp32 result
    if out is None:  # no key slot at all on this rank: the merge identity
        return q.new_zeros((n, h, d), dtype=torch.float32), q.new_full((n, h), float("-inf"), dtype=torch.float32)
    return out, lse
