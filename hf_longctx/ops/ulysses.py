"""Ulysses head/sequence all-to-all with GQA (DeepSpeed-Ulysses §3; USP paper Algorithm 1).

Where it sits: first and last step of `ops/usp.py` (and of every FPDT chunk). One
all-to-all gives every rank of a Ulysses group of U the ring rank's whole stream for H/U
heads; the inverse brings the output back to the sequence layout.
GQA/MQA (query head h reads KV head h // (H / H_kv)): KV heads split evenly when
H_kv % U == 0; when H_kv < U each is replicated only as far as needed and autograd sums
the replicas' gradients. Any other combination would make a rank read another's KV heads:
refused."""

from __future__ import annotations

import torch

from hf_longctx.distributed.comm import all_to_all_head_to_seq, all_to_all_seq_to_head


def kv_replication(heads: int, kv_heads: int, ulysses: int) -> int:
    """How many times to replicate each KV head so that H_kv·f splits evenly over U ranks
    and every rank gets exactly the KV heads its query heads read. Raises ValueError."""
    if heads % ulysses:
        raise ValueError(f"query heads ({heads}) must be divisible by ulysses degree ({ulysses})")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    per_rank = heads // ulysses  # query heads on one Ulysses rank
    group = heads // kv_heads  # query heads per KV head
    if per_rank % group == 0:
        return 1  # whole KV groups per rank: H_kv % U == 0
    if group % per_rank == 0:
        return group // per_rank  # replicate: H_kv·f = U·(KV heads per rank) with one KV head per rank
    raise ValueError(
        f"heads not divisible after replication: {heads} query heads / ulysses {ulysses} = {per_rank} per rank, "
        f"but each of the {kv_heads} KV heads serves {group} query heads; a rank's heads would span KV groups"
    )


def replicate_kv(q, k, v, ulysses: int):
    """k/v [B, S_local, H_kv, D] → [B, S_local, H_kv·f, D] with f = `kv_replication` (replica i
    of head j at j·f + i). Autograd's backward of repeat_interleave is a sum over the replicas
    (expand's backward), which accumulates bf16 in fp32 and rounds once -- bitwise what an
    explicit fp32 sum gives. Used before every Ulysses all-to-all (USP and FPDT)."""
    f = kv_replication(q.shape[2], k.shape[2], ulysses)
    if f > 1:
        k, v = k.repeat_interleave(f, dim=2), v.repeat_interleave(f, dim=2)
    return k, v


def scatter_heads(q, k, v, group, ulysses: int):
    """q [B, S_local, H, D], k/v [B, S_local, H_kv, D] → q [B, S_ring, H/U, D], k/v [B, S_ring, H_kv·f/U, D]."""
    k, v = replicate_kv(q, k, v, ulysses)
    return all_to_all_seq_to_head(q, k, v, group=group)


def gather_heads(out: torch.Tensor, group) -> torch.Tensor:
    """[B, S_ring, H/U, D] → [B, S_local, H, D]."""
    (out,) = all_to_all_head_to_seq(out, group=group)
    return out
