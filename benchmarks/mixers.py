"""Linear mixers under SP: traffic per layer vs attention, and a hybrid vs all-attention step.

Where it sits: outside the library; it drives `ops/mixers/` and the public path (`patch`,
`shard_batch`) on 4 gloo ranks of this machine and prints two tables.

Table 1 -- bytes each rank SENDS to other ranks per layer (forward + backward), for every
mixer scheme at the dimensions of transformers 5.23's default config of a family, next to
that config's attention layer under Ulysses (U = 4, R = 1). "counted": every
`all_to_all_single` of the step is intercepted and the bytes leaving the rank summed
(the piece a rank sends to itself is not traffic); the GDN/SSD core is replaced by a cheap
stand-in there (traffic does not depend on it). "formula" (P = SP degree, S_l = tokens per
rank, b = bytes per element, even head splits; a rank receives its heads from P-1 peers):
- Ulysses attention: 2 · S_l·(P-1)/P · D·(2·H + 2·H_kv') · b,   H_kv' = max(H_kv, P)
- GDN:     2 · S_l·(P-1)/P · (2·H_k'·D_k + 2·H_v·D_v + 2·H_v) · b,   H_k' = max(H_k, P)
- Mamba-2: 2 · S_l·(P-1)/P · (2·I + 2·G'·N + H) · b,   G' = max(G, P)
- halo conv: 2 · C · (rows fetched) · b, rows ≤ (K-1) per local run that does not start a document
(2 = forward + the backward's gradients of the same tensors.)

Table 2 -- a tiny Qwen3.5-shaped hybrid (3 Gated DeltaNet layers : 1 attention layer) on 4
gloo ranks, one training step (forward, backward, SGD) with the wrappers, vs the same
model with full attention in every layer: step time (worst rank) and peak tensor memory
per rank (`MemTracker`, worst rank).

Run: /work/main/.venv/bin/python benchmarks/mixers.py                 (about 5 minutes on 2 shared CPU cores)
     /work/main/.venv/bin/python benchmarks/mixers.py --tokens 2048 --step-tokens 4096   (quicker)
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from benchmarks._ranks import run_ranks

WORLD = 4


class CountSent:
    """Counts the bytes this rank sends to OTHER ranks through `dist.all_to_all_single`."""

    def __init__(self, rank: int):
        self.rank, self.bytes = rank, 0

    def __enter__(self):
        self._orig = dist.all_to_all_single

        def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            n = dist.get_world_size(group)
            own = input_split_sizes[dist.get_group_rank(group, dist.get_rank())] if input_split_sizes else input.numel() // n
            self.bytes += (input.numel() - own) * input.element_size()
            return self._orig(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._orig


def _docs(total: int) -> tuple:
    """Four unequal documents, lengths multiples of 8, summing to `total`."""
    a, b, c = total // 2, total // 4, total // 8
    cu = [0, a, a + b, a + b + c, total]
    return tuple(cu)


def _backward(out: torch.Tensor, inputs) -> None:
    torch.autograd.grad(out.float().square().sum(), inputs)


def _attention_bytes(mesh, cu, h, h_kv, d) -> int:
    from hf_longctx.ops.usp import usp_attention

    s_l = cu[-1] // mesh.sp
    q = torch.randn(1, s_l, h, d, requires_grad=True)
    k, v = (torch.randn(1, s_l, h_kv, d, requires_grad=True) for _ in range(2))
    with CountSent(dist.get_rank()) as c:
        _backward(usp_attention(q, k, v, mesh, cu_seqlens=cu), [q, k, v])
    return c.bytes


def _stand_in_core(q, k, v, g, beta, **_):
    return v * beta[..., None], None  # same shapes and graph edges as the real core, no recurrence


def _stand_in_scan(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, **_):
    return x.float() * D[:, None]


def _mixer_bytes(kind: str, cfg, mesh, lay) -> int:
    from hf_longctx.ops.mixers.conv import halo_conv
    from hf_longctx.ops.mixers.gdn import GDNHeads, gdn_sequence_parallel
    from hf_longctx.ops.mixers.mamba2 import Mamba2Heads, mamba2_sequence_parallel

    s_l = lay.local_length
    with CountSent(dist.get_rank()) as c:
        if kind == "gdn":
            hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
            conv_dim, k = 2 * hk * dk + hv * dv, cfg.linear_conv_kernel_dim
            x, beta, a = (torch.randn(1, s_l, n, requires_grad=True) for n in (conv_dim, hv, hv))
            out = gdn_sequence_parallel(
                x, beta, a, conv_weight=torch.randn(conv_dim, k), conv_bias=None, activation=F.silu, A_log=torch.zeros(hv),
                dt_bias=torch.zeros(hv), head_k_dim=dk, head_v_dim=dv, heads=GDNHeads.split(hk, hv, mesh.sp),
                core=_stand_in_core, lay=lay, rank=mesh.sp_rank, group=mesh.sp_group,
            )
            _backward(out, [x, beta, a])
        elif kind == "mamba2":
            h = getattr(cfg, "mamba_n_heads", None) or cfg.mamba_num_heads
            p = getattr(cfg, "mamba_d_head", None) or cfg.mamba_head_dim
            g = getattr(cfg, "mamba_n_groups", None) or cfg.n_groups
            n = getattr(cfg, "mamba_d_state", None) or cfg.ssm_state_size
            conv_dim = h * p + 2 * g * n
            x, dt = torch.randn(1, s_l, conv_dim, requires_grad=True), torch.randn(1, s_l, h, requires_grad=True)
            out = mamba2_sequence_parallel(
                x, dt, conv_weight=torch.randn(conv_dim, 4), conv_bias=None, activation=F.silu, A_log=torch.zeros(h),
                D=torch.ones(h), dt_bias=torch.zeros(h), dt_limit=(0.0, float("inf")), head_dim=p, state=n, chunk_size=256,
                heads=Mamba2Heads.split(h, g, mesh.sp), scan=_stand_in_scan, lay=lay, rank=mesh.sp_rank, group=mesh.sp_group,
            )
            _backward(out, [x, dt])
        else:  # halo short convolution
            x = torch.randn(1, s_l, cfg.hidden_size, requires_grad=True)
            out = halo_conv(x, lay, torch.randn(cfg.hidden_size, cfg.conv_L_cache), None, mesh.sp_rank, mesh.sp_group)
            _backward(out, [x])
    return c.bytes


def _formula(kind: str, cfg, p: int, s_l: int, lay, rank: int, b: int = 4) -> int:
    share = s_l * (p - 1) / p
    if kind == "attention":
        h, h_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
        return int(2 * share * d * (2 * h + 2 * max(h_kv, p)) * b)
    if kind == "gdn":
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        return int(2 * share * (2 * max(hk, p) * cfg.linear_key_head_dim + 2 * hv * cfg.linear_value_head_dim + 2 * hv) * b)
    if kind == "mamba2":
        h = getattr(cfg, "mamba_n_heads", None) or cfg.mamba_num_heads
        inner = h * (getattr(cfg, "mamba_d_head", None) or cfg.mamba_head_dim)
        g = getattr(cfg, "mamba_n_groups", None) or cfg.n_groups
        n = getattr(cfg, "mamba_d_state", None) or cfg.ssm_state_size
        return int(2 * share * (2 * inner + 2 * max(g, p) * n + h) * b)
    # halo: K-1 rows per local run that does not start its document, minus rows the rank holds
    return 2 * cfg.hidden_size * sum(lay.halo(cfg.conv_L_cache).recv_counts[rank]) * b


FAMILIES = [  # (label, config class name, mixer scheme)
    ("Qwen3.5 (GDN)", "Qwen3_5TextConfig", "gdn"),
    ("Qwen3-Next (GDN)", "Qwen3NextConfig", "gdn"),
    ("Bamba / Granite-4 (Mamba-2, G=1)", "BambaConfig", "mamba2"),
    ("Nemotron-H (Mamba-2, G=8)", "NemotronHConfig", "mamba2"),
    ("LFM2 (short conv, K=3)", "Lfm2Config", "conv"),
]


def _traffic(args) -> list:
    import transformers as tf

    from hf_longctx.distributed.mesh import init_sequence_parallel
    from hf_longctx.ops.mixers.layout import SequenceLayout

    mesh = init_sequence_parallel(WORLD, 1)
    cu = _docs(args.tokens)
    lay = SequenceLayout(cu, mesh.ring, mesh.ulysses)
    rows = []
    for label, cls, kind in FAMILIES:
        cfg = getattr(tf, cls)()
        h = cfg.num_attention_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
        mixer = _mixer_bytes(kind, cfg, mesh, lay)
        attn = _attention_bytes(mesh, cu, h, cfg.num_key_value_heads, d)
        p, s_l = mesh.sp, lay.local_length
        rows.append((label, mixer, _formula(kind, cfg, p, s_l, lay, mesh.sp_rank), attn, _formula("attention", cfg, p, s_l, lay, mesh.sp_rank)))
    return rows


def _hybrid_config(all_attention: bool):
    import transformers as tf

    layers = ["full_attention"] * 4 if all_attention else ["linear_attention"] * 3 + ["full_attention"]
    return tf.Qwen3_5TextConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, layer_types=layers, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, pad_token_id=0,
    )


def _step(all_attention: bool, tokens: int) -> tuple:
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM

    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.distributed.mesh import init_sequence_parallel
    from hf_longctx.integrations.model_patch import patch

    mesh = init_sequence_parallel(WORLD, 1)
    torch.manual_seed(0)
    model = patch(AutoModelForCausalLM.from_config(_hybrid_config(all_attention), dtype=torch.float32).train(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cu = _docs(tokens)
    ids = torch.randint(1, 2048, (1, tokens))
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]
    shard = shard_batch({"input_ids": ids, "labels": ids.clone(), "position_ids": pos}, mesh)

    def step():
        model(**shard).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    peak = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    times = []
    for _ in range(2):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return peak, min(times)


def _worker(rank: int, init_file: str, args, results) -> None:
    import warnings

    warnings.filterwarnings("ignore", message="Module is None")  # MemTracker on modules without a backward hook
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(minutes=30))
    traffic = _traffic(args)
    steps = {name: _step(name == "all attention", args.step_tokens) for name in ("hybrid + wrappers", "all attention")}
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, (traffic, steps))
    if rank == 0:
        results.put(gathered)
    dist.destroy_process_group()


def _print(args, gathered) -> None:
    mib = 2**20
    print(f"\nTable 1: bytes sent per rank per layer, forward + backward, fp32; {args.tokens} packed tokens "
          f"(4 documents) on {WORLD} gloo ranks; attention = Ulysses U={WORLD}; mean over ranks")
    print("| model (transformers default config) | mixer counted MiB | mixer formula MiB | attention counted MiB | attention formula MiB | mixer / attention |")
    print("|---|---|---|---|---|---|")
    for i, (label, *_) in enumerate(gathered[0][0]):
        mix, mix_f, att, att_f = (sum(g[0][i][j] for g in gathered) / WORLD for j in (1, 2, 3, 4))
        print(f"| {label} | {mix / mib:.2f} | {mix_f / mib:.2f} | {att / mib:.2f} | {att_f / mib:.2f} | {mix / att:.2f} |")
    print(f"\nTable 2: tiny Qwen3.5-shaped model (hidden 256, 4 layers), {args.step_tokens} packed tokens on {WORLD} gloo "
          "ranks (U=4), one SGD step, worst rank")
    print("| model | step s | peak MiB / rank |")
    print("|---|---|---|")
    for name in gathered[0][1]:
        secs = max(g[1][name][1] for g in gathered)
        peak = max(g[1][name][0] for g in gathered)
        print(f"| {name} | {secs:.2f} | {peak / mib:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="packed tokens for the traffic table")
    parser.add_argument("--step-tokens", type=int, default=16384, help="packed tokens of the timed step")
    args = parser.parse_args()
    gathered = run_ranks(_worker, WORLD, args)
    _print(args, gathered)


if __name__ == "__main__":
    main()
