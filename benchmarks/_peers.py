"""Peer implementations for benchmarks/attention.py: DeepSpeed's HF Ulysses and yunchang's USP.

Every function here is called on EVERY rank, in the same order, and does its risky work
(imports, JIT builds, kernel probes) locally, with no collective in flight; the caller then
agrees on the outcome with `agree` before any rank runs a collective through the peer. A
peer that fails on one rank is therefore dropped on all ranks instead of leaving the others
blocked in an all-to-all that rank never joins.

DeepSpeed on CPU/gloo. `deepspeed.init_distributed(dist_backend="gloo")` on a process group
that is already initialised only wraps it (`deepspeed.comm.TorchBackend`, every collective
forwarded to `torch.distributed`). The CPU accelerator picks gloo unless
`oneccl_bindings_for_pytorch` is installed (then "ccl"); `DS_ACCELERATOR=cpu` forces the
CPU accelerator. The wrapper JIT-builds DeepSpeed's shared-memory all-reduce op, which
joins peers only when `LOCAL_SIZE` equals the world size (its `shm_initialize` spins until
every rank's segment exists); `UlyssesSPAttentionHF` uses no all-reduce, so LOCAL_SIZE is
removed here to keep that rendezvous off. Nothing of this needs a GPU.

yunchang on CPU. Its torch backends: TORCH_FLASH / TORCH_EFFICIENT / TORCH_CUDNN call
CUDA-only aten ops; TORCH_MATH runs on CPU but returns an all-zero LSE, so the ring merge
of its blocks is not exact attention once ring > 1; and its backward
(`pytorch_attn_backward`) raises "Not implemented" for every torch backend: yunchang cannot
train on CPU. A kernel that raises inside `LongContextAttention` does so after the ring's
isend/irecv are posted, and the next call on that ring group then hangs, which is why
backends are probed on the bare kernels, never by calling the module and catching.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def agree(ok: bool) -> bool:
    """True on every rank iff `ok` on every rank (a MIN all-reduce over the world)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:140] if str(e) else ''}"


def deepspeed_ulysses(group, q, k, v, dout, h, hkv, d):
    """DeepSpeed `UlyssesSPAttentionHF` around transformers' sdpa attention, on `group`.

    q/k/v/dout: this rank's contiguous shard, [1, S_local, H(_kv), D]. Returns `run()` doing
    one forward+backward and returning the output as [1, S_local, H, D]. Local work only.
    """
    os.environ.pop("LOCAL_SIZE", None)  # keep DeepSpeed's shm all-reduce rendezvous off (see module doc)
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # wraps the existing gloo group
    sl = q.shape[1]
    rank = dist.get_rank(group)
    ds = UlyssesSPAttentionHF(
        attn=sdpa_attention_forward, batch_size=1, attn_head_count=h, attn_head_size=d, kv_head_count=hkv,
        num_hidden_layers=1, process_group=group, seq_length_is_variable=True,
    )
    ds.core_attn_implementation = "sdpa"
    module = torch.nn.Module()  # what HF passes as `module`: its attention layer
    module.is_causal, module.num_key_value_groups = True, h // hkv
    local = [t.transpose(1, 2).contiguous() for t in (q, k, v)]  # [1, H, S_local, D], as HF hands attention
    pos = torch.arange(rank * sl, (rank + 1) * sl)[None]  # global positions: DeepSpeed all-gathers them
    dflat = dout.reshape(1, sl, h * d)  # DeepSpeed returns [B, S_local, H·D]

    # Local probe of the kernel it will dispatch to (sdpa fwd+bwd, causal, CPU): no collective.
    tiny = [t[:, :, :8].detach().requires_grad_() for t in local]
    sdpa_attention_forward(module, *tiny, None, scaling=d ** -0.5)[0].sum().backward()

    def run():
        ins = [t.detach().requires_grad_() for t in local]
        out, _ = ds(module, *ins, None, dropout=0.0, scaling=d ** -0.5, position_ids=pos)
        out.backward(dflat)
        return out.detach().view(1, sl, h, d)

    return run


def yunchang_import():
    from yunchang import LongContextAttention, set_seq_parallel_pg  # noqa: F401
    from yunchang.kernels import AttnType  # noqa: F401


def yunchang_probe():
    """Locally probe yunchang's CPU-capable torch backends. Returns ({name: ok}, {name: bwd error or None})."""
    from yunchang.kernels import AttnType, select_flash_attn_impl

    fwd, bwd = {}, {}
    for at in (AttnType.TORCH_FLASH, AttnType.TORCH_EFFICIENT, AttnType.TORCH_MATH):
        q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))  # [B, S, H, D] as yunchang's kernels take them
        try:
            out, lse = select_flash_attn_impl(at, stage="fwd-only")(q, k, v, causal=True, softmax_scale=0.25)
            fwd[at.value] = True
        except Exception as e:
            fwd[at.value] = False
            bwd[at.value] = f"forward fails: {short(e)}"
            continue
        try:  # the kernel LongContextAttention's ring backward calls for this backend
            bufs = [torch.empty_like(t) for t in (q, k, v)]
            select_flash_attn_impl(at, stage="bwd-only")(
                torch.ones_like(out), q, k, v, out, lse, *bufs, 0.0, 0.25, True, (-1, -1), 0.0, None, False,
                rng_state=None)
            bwd[at.value] = None
        except Exception as e:
            bwd[at.value] = short(e)
    return fwd, bwd


def yunchang_usp(attn_type: str, q, k, v):
    """yunchang `LongContextAttention` forward on the groups `set_seq_parallel_pg` made.

    q/k/v: this rank's contiguous shard [1, S_local, H, D] (yunchang's "basic" ring, Ulysses
    inner). Returns `run()` doing one forward (no grad), returning [1, S_local, H, D].
    """
    from yunchang import LongContextAttention
    from yunchang.kernels import AttnType

    attn = LongContextAttention(attn_type=AttnType(attn_type))

    def run():
        with torch.no_grad():
            return attn(q, k, v, causal=True)

    return run
