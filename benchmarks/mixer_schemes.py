"""Linear recurrences under SP: state passing vs the head all-to-all, measured on CPU and modelled to 64 GPUs.

Where it sits: outside the library; drives `ops/mixers/` (gdn.py / gdn_state.py, mamba2.py /
mamba2_state.py) on spawned gloo ranks of this machine and `ops/mixers/cost.py` for the
modelled rows. Prints three tables.

Table 1 (measured, CPU, gloo): one Gated DeltaNet and one Mamba-2 layer core (conv +
recurrence + exchange, forward + backward through transformers' torch kernels) at SP 2
and 4, ONE document of 32K or 128K tokens spanning the group (Ulysses layout), both
schemes: bytes each rank SENDS to other ranks (every `all_to_all_single` intercepted, mean
over ranks), wall time (worst rank, best of --reps after a warm-up) and the bytes autograd
saves for the backward per local token (worst rank; every saved tensor's storage once,
fp32 here: the activation memory a layer adds per token, its device memory on a GPU). Small CPU-sized
heads (below) so a 128K-token layer fits 2 shared cores; the bytes of the state scheme do
not depend on the tokens, those of the head all-to-all grow with them.

Table 2 (modelled, `cost.py`, transformers' default configs of Qwen3-Next (GDN) and
Nemotron-H (Mamba-2), bf16): bytes per layer per rank, both schemes, SP 2-64, 32K and 128K
tokens; the same formulas Table 1's counted bytes check.

Table 3 (modelled): 1M tokens on 8 nodes × 8 GPUs (one SP group of 64 = ulysses 8 × ring 8,
16K tokens per GPU) with `GroupCost.from_config`'s constants (300 GB/s inside a node,
40 GB/s across, 30 µs per collective, 0.5 × 989 TFLOP/s): seconds per layer of each scheme
(communication + state passing's extra FLOPs), and what `patch(mixers="auto")` picks. The
head all-to-all is impossible where the group is larger than the heads (Qwen3-Next: 32 value
heads < 64 ranks).

    PYTHONPATH=. python benchmarks/mixer_schemes.py --reps 1         (about an hour on 2 busy shared cores)
    PYTHONPATH=. python benchmarks/mixer_schemes.py --tokens 8192 --reps 1   (quick)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._ranks import run_ranks  # noqa: E402
from benchmarks.mixers import CountSent  # noqa: E402

CPU_DIMS = {  # (heads, groups, key_dim, head_dim): per-kind sizes a 2-core CPU runs at 128K tokens
    "GDN": (4, 2, 16, 16),  # H_v, H_k, D_k, D_v: 4 value heads, so the head all-to-all runs on SP 4 too
    "Mamba-2": (4, 1, 8, 8),  # H, G, N, P_h; scan chunks of 64
}


def _inputs(kind: str, s_local: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    h, grp, dk, dv = CPU_DIMS[kind]
    if kind == "GDN":
        conv = 2 * grp * dk + h * dv
        x = torch.randn(1, s_local, conv, generator=g)
        beta, a = torch.rand(1, s_local, h, generator=g), torch.randn(1, s_local, h, generator=g)
        params = [torch.randn(conv, 4, generator=g) * 0.3, torch.zeros(h), torch.zeros(h)]
        return [x, beta, a], params
    conv = h * dv + 2 * grp * dk
    x, dt = torch.randn(1, s_local, conv, generator=g), torch.randn(1, s_local, h, generator=g)
    params = [torch.randn(conv, 4, generator=g) * 0.3, torch.zeros(h), torch.ones(h), torch.zeros(h)]
    return [x, dt], params


def _layer(kind: str, scheme: str, ins, params, lay, rank, group):
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from hf_longctx.ops.mixers.gdn import GDNHeads, gdn_sequence_parallel
    from hf_longctx.ops.mixers.gdn_state import gdn_state_passing
    from hf_longctx.ops.mixers.mamba2 import Mamba2Heads, mamba2_sequence_parallel
    from hf_longctx.ops.mixers.mamba2_state import mamba2_state_passing

    h, grp, dk, dv = CPU_DIMS[kind]
    if kind == "GDN":
        common = dict(conv_weight=params[0], conv_bias=None, activation=F.silu, A_log=params[1], dt_bias=params[2],
                      head_k_dim=dk, head_v_dim=dv, core=torch_chunk_gated_delta_rule, lay=lay, rank=rank, group=group)
        if scheme == "state":
            return gdn_state_passing(*ins, k_heads=grp, varlen=False, **common)
        return gdn_sequence_parallel(*ins, heads=GDNHeads.split(grp, h, lay.sp), **common)
    common = dict(conv_weight=params[0], conv_bias=None, activation=F.silu, A_log=params[1], D=params[2], dt_bias=params[3],
                  dt_limit=(0.0, float("inf")), head_dim=dv, state=dk, chunk_size=64, scan=mamba2_chunk_scan, lay=lay,
                  rank=rank, group=group)
    if scheme == "state":
        return mamba2_state_passing(*ins, heads=h, groups=grp, **common)
    return mamba2_sequence_parallel(*ins, heads=Mamba2Heads.split(h, grp, lay.sp), **common)


def _measure(sp: int, rank: int, tokens: int, kind: str, scheme: str, reps: int) -> tuple[float, float, float]:
    """(bytes sent, best seconds, bytes saved for backward per local token) of one layer core."""
    from hf_longctx.ops.mixers.layout import SequenceLayout

    lay = SequenceLayout((0, tokens), 1, sp)  # one document over the whole group
    ins, params = _inputs(kind, lay.local_length, seed=rank)
    ins = [t.requires_grad_() for t in ins]
    params = [p.requires_grad_() for p in params]

    saved: dict[int, int] = {}  # storage -> bytes of every tensor autograd keeps for the backward

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def step(count: bool = False):
        with torch.autograd.graph.saved_tensors_hooks(keep if count else (lambda t: t), lambda t: t):
            out = _layer(kind, scheme, ins, params, lay, rank, dist.group.WORLD)
        torch.autograd.grad(out.float().square().mean(), ins + params)

    with CountSent(rank) as c:
        step(count=True)  # warm-up (plans, uploads), the byte count and the saved activations
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return float(c.bytes), min(times), sum(saved.values()) / lay.local_length


def _worker(rank: int, init_file: str, args, results) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.sp,
                            timeout=timedelta(minutes=60))
    rows = {}
    for tokens in args.token_list:
        for kind in CPU_DIMS:
            for scheme in ("heads", "state"):
                if scheme == "heads" and args.sp > CPU_DIMS[kind][0]:
                    raise SystemExit(f"--sizes {args.sp}: more ranks than the {kind} heads of CPU_DIMS")
                rows[(tokens, kind, scheme)] = _measure(args.sp, rank, tokens, kind, scheme, args.reps)
    gathered = [None] * args.sp
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        results.put(gathered)
    dist.destroy_process_group()


def _real_dims():
    import transformers as tf

    from hf_longctx.ops.mixers.cost import mixers_of_config

    return {"Qwen3-Next GDN": mixers_of_config(tf.Qwen3NextConfig())[0][0],
            "Nemotron-H Mamba-2": mixers_of_config(tf.NemotronHConfig())[0][0]}


def _modelled(args) -> None:
    from hf_longctx.ops.mixers.cost import Links, choose, head_traffic, one_document_state_traffic

    mib = 2**20
    print("\nTable 2 (modelled, ops/mixers/cost.py): bytes sent per layer per rank, forward + backward, bf16, one document "
          "over the group (ulysses up to 8, then ring: zigzag), transformers' default configs")
    print("| mixer | SP | heads 32K MiB | state 32K MiB | heads 128K MiB | state 128K MiB |")
    print("|---|---|---|---|---|---|")
    for label, d in _real_dims().items():
        for sp in (2, 4, 8, 16, 32, 64):
            u, r = min(sp, 8), max(1, sp // 8)
            cells = []
            for tokens in (32768, 131072):
                heads = "n/a (SP > heads)" if sp > d.heads else f"{head_traffic(d, sp, tokens / sp, 2).bytes / mib:.1f}"
                cells += [heads, f"{one_document_state_traffic(d, u, r, tokens / sp, 2).bytes / mib:.2f}"]
            print(f"| {label} | {sp} | " + " | ".join(cells) + " |")
    links = Links.of_group(64, 8)
    print("\nTable 3 (modelled): 1M tokens on 8 x 8 GPUs (SP 64 = ulysses 8 x ring 8, 16K tokens per GPU), GroupCost "
          f"constants ({links.bandwidth / 1e9:g} GB/s across nodes, {links.latency * 1e6:g} us per collective, "
          f"{links.flops_per_s / 1e12:g} TFLOP/s), seconds per layer (forward + backward)")
    print("| mixer | head all-to-all ms | state passing ms (comm + extra compute) | state MiB / rank | auto picks |")
    print("|---|---|---|---|---|")
    for label, d in _real_dims().items():
        heads = head_traffic(d, 64, 16384, 2)
        state = one_document_state_traffic(d, 8, 8, 16384, 2)
        sec = lambda t: t.seconds(links.bandwidth, links.latency, links.flops_per_s) * 1e3  # noqa: E731
        h = f"n/a (SP 64 > {d.heads} heads)" if 64 > d.heads else f"{sec(heads):.2f}"
        comm = state.bytes / links.bandwidth * 1e3 + state.calls * links.latency * 1e3
        print(f"| {label} | {h} | {sec(state):.2f} ({comm:.2f} + {state.flops / links.flops_per_s * 1e3:.2f}) | "
              f"{state.bytes / mib:.1f} | {choose(d, 64, heads, state, links)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="32768,131072", help="comma-separated packed token counts of Table 1")
    parser.add_argument("--reps", type=int, default=2, help="timed repetitions per cell (best kept)")
    parser.add_argument("--sizes", default="2,4", help="SP sizes of Table 1")
    args = parser.parse_args()
    args.token_list = [int(t) for t in args.tokens.split(",")]
    mib = 2**20
    print("Table 1 (measured, CPU gloo, transformers' torch kernels): one layer core forward + backward, one document; "
          f"GDN H_v/H_k/D_k/D_v = {'/'.join(map(str, CPU_DIMS['GDN']))}, Mamba-2 H/G/N/P = "
          f"{'/'.join(map(str, CPU_DIMS['Mamba-2']))}; bytes = mean per rank, time = worst rank")
    print("| mixer | SP | tokens | heads MiB | state MiB | heads s | state s | state / heads time | saved B/token heads | saved B/token state |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for sp in (int(s) for s in args.sizes.split(",")):
        args.sp = sp
        gathered = run_ranks(_worker, sp, args)
        for tokens in args.token_list:
            for kind in CPU_DIMS:
                cell = {s: [g[(tokens, kind, s)] for g in gathered] for s in ("heads", "state")}
                b = {s: sum(x[0] for x in v) / sp / mib for s, v in cell.items()}
                t = {s: max(x[1] for x in v) for s, v in cell.items()}
                m = {s: max(x[2] for x in v) for s, v in cell.items()}
                print(f"| {kind} | {sp} | {tokens // 1024}K | {b['heads']:.2f} | {b['state']:.3f} | {t['heads']:.2f} | "
                      f"{t['state']:.2f} | {t['state'] / t['heads']:.2f} | {m['heads']:.0f} | {m['state']:.0f} |", flush=True)
    _modelled(args)


if __name__ == "__main__":
    main()
