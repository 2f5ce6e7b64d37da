"""USP attention on 4 gloo ranks: layouts side by side, against DeepSpeed's HF Ulysses and yunchang.

Prints one table. Every configuration runs forward+backward on the same global shapes in
the same 4 processes, interleaved repetition by repetition (this machine is noisy, so
only ratios measured in one run mean anything), and reports the median. Bytes are
COUNTED by wrapping the collectives during one call, and put next to the per-rank volume
derived from first principles (USP paper §4.1 / Table 2 form):

  Ulysses (S tokens, U ranks, hidden d = H·D, d_kv = H_kv·D, e bytes/elt):
      fwd q,k,v,out + bwd dout,dq,dk,dv all-to-alls, each sending (U-1)/U of the local block
      = 2 · (U-1)/U · S/U · (2d + 2d_kv) · e
  Ring (R ranks, zigzag; S/R tokens per rank):
      fwd (R-1) K/V hops + bwd (R-1) K/V hops at e bytes, R dK/dV hops in fp32
      = 2·(R-1)·S/R·2d_kv·e + R·S/R·2d_kv·4
  USP (U × R): the Ulysses term with S/R tokens per Ulysses group, plus the ring term
      with d_kv/U per rank.

Peers (optional; `pip install deepspeed yunchang`, helpers in benchmarks/_peers.py):
  * DeepSpeed's `UlyssesSPAttentionHF` wrapping transformers' `sdpa_attention_forward`
    (Ulysses degree 4, same shapes, forward+backward), interleaved with ours. It runs on
    CPU/gloo as is: `deepspeed.init_distributed(dist_backend="gloo")` on the already
    initialised gloo group only wraps it (CPU accelerator: gloo unless
    oneccl_bindings_for_pytorch is installed; `DS_ACCELERATOR=cpu` forces the CPU
    accelerator). LOCAL_SIZE is unset so its shm all-reduce op never rendezvouses.
  * yunchang's `LongContextAttention` on USP 2x2, forward only, next to ours forward only.
    Of its torch backends only TORCH_MATH runs on CPU; it returns a zero LSE, so with
    ring > 1 its output is NOT exact attention ('max err' column), and its backward raises
    for every torch backend: yunchang cannot train on CPU (recorded in the notes).
Every rank takes the same path: peer setup is local, then agreed with a MIN all-reduce;
a runner failing on any rank is dropped on all ranks, never left half-way through a
collective. A runner that fails on one rank INSIDE a collective leaves the others
blocked in it; the parent then stops every rank after `--timeout` seconds without
progress and prints each rank's phase and the notes (never a silent hang).
(Backends are probed on yunchang's bare kernels, with no communication: its TORCH_FLASH
can raise inside the ring after its isend/irecv are posted, and a retry with the next
backend would then wait forever on that ring group.)
DeepSpeed JIT-builds an op and may abort at interpreter exit, so all ranks run in child
processes and the parent only reads their results. `--watchdog N` dumps every rank's
stack every N seconds; 'max err' is the largest |out - single-process causal attention|.

Run:  python benchmarks/attention.py [--seq 4096 --heads 16 --kv-heads 16 --dim 64 --reps 5] [--peers]
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import queue
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class ByteCounter:
    """Counts bytes this rank sends, and collective calls, through all_to_all_single / batch_isend_irecv / all_gather."""

    def __init__(self):
        self.sent = 0
        self.calls = 0
        self._saved = {}

    def __enter__(self):
        counter = self
        orig_a2a, orig_p2p, orig_ag = dist.all_to_all_single, dist.batch_isend_irecv, dist.all_gather

        def a2a(output, input, *args, group=None, **kw):
            n = dist.get_world_size(group)
            counter.sent += input.numel() * input.element_size() * (n - 1) // n  # own slice stays local
            counter.calls += 1
            return orig_a2a(output, input, *args, group=group, **kw)

        def p2p(ops):
            counter.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            counter.calls += 1
            return orig_p2p(ops)

        def ag(tensor_list, tensor, group=None, **kw):
            counter.sent += tensor.numel() * tensor.element_size() * (dist.get_world_size(group) - 1)
            counter.calls += 1
            return orig_ag(tensor_list, tensor, group=group, **kw)

        self._saved = dict(all_to_all_single=orig_a2a, batch_isend_irecv=orig_p2p, all_gather=orig_ag)
        dist.all_to_all_single, dist.batch_isend_irecv, dist.all_gather = a2a, p2p, ag
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def formula_bytes(u: int, r: int, s: int, h: int, hkv: int, d: int, e: int) -> int:
    """Per-rank bytes sent by one forward+backward, from first principles (see module docstring)."""
    from hf_longctx.ops.ulysses import kv_replication

    kv_heads = hkv * kv_replication(h, hkv, u)  # KV heads entering the all-to-all (replicated if H_kv < U)
    s_local = s // (u * r)
    ulysses = 2 * (u - 1) / u * s_local * (2 * h + 2 * kv_heads) * d * e  # fwd q,k,v,out + bwd dout,dq,dk,dv
    w = kv_heads // u * d  # K (or V) width per rank in the ring
    ring = 2 * (r - 1) * (s // r) * 2 * w * e + r * (s // r) * 2 * w * 4 if r > 1 else 0  # K/V hops + fp32 dK/dV hops
    return int(ulysses + ring)


def _ours(mesh, q, k, v, cu):
    from hf_longctx.ops.usp import usp_attention

    # HF hands attention [B, H, S_local, D]; usp_attention takes [B, S_local, H, D] views.
    out = usp_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mesh, cu_seqlens=cu)
    return out


def _reference(q, k, v, idx):
    """Single-process causal attention for the global rows `idx`: [1, len(idx), H, D]."""
    mask = idx[:, None] >= torch.arange(q.shape[1])[None, :]
    gqa = q.shape[2] != k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, idx].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2)


def _add_peers(rank, world, q, k, v, dout, args, meshes, runners, note):
    """Add DeepSpeed's and yunchang's runners; every rank takes the same branch (see _peers.py)."""
    from _peers import agree, deepspeed_ulysses, short, yunchang_import, yunchang_probe, yunchang_usp

    h, hkv, d, sl = args.heads, args.kv_heads, args.dim, args.seq // world
    shard = lambda t: t[:, rank * sl:(rank + 1) * sl].contiguous()  # noqa: E731  contiguous, as both peers shard
    idx = torch.arange(rank * sl, (rank + 1) * sl)

    name = "deepspeed UlyssesSPAttentionHF 4x1"
    try:
        run, err = deepspeed_ulysses(meshes[(4, 1)].ulysses_group, *map(shard, (q, k, v, dout)), h, hkv, d), None
    except Exception as e:
        run, err = None, short(e)
    if agree(err is None):
        runners[name] = (run, 4, 1, idx)
    else:
        note(f"deepspeed skipped on all ranks: {err or 'another rank failed its setup'}")

    try:
        yunchang_import()
        err = None
    except Exception as e:
        err = short(e)
    if not agree(err is None):
        note(f"yunchang skipped on all ranks: {err or 'another rank failed to import it'}")
        return
    from yunchang import set_seq_parallel_pg

    set_seq_parallel_pg(2, 2, rank, world)  # creates its groups: on every rank, in the same order
    fwd, bwd = yunchang_probe()
    names = sorted(fwd)
    ok = torch.tensor([int(fwd[n]) for n in names], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    usable = [n for n, o in zip(names, ok.tolist()) if o]
    for n in names:
        note(f"yunchang {n} on CPU: " + ((bwd.get(n) or "forward fails on another rank") if n not in usable else
             "forward runs; " + ("backward runs" if bwd.get(n) is None else f"backward fails: {bwd[n]}")))
    if not usable:
        note("yunchang skipped: no torch backend runs forward on CPU")
        return
    at = "torch_math" if "torch_math" in usable else usable[0]
    trains = agree(bwd.get(at) is None)
    note(f"yunchang LongContextAttention 2x2 uses {at}; it can{'' if trains else ' NOT'} train on CPU"
         + ("" if trains else " (its ring backward raises for every torch backend), so it is timed forward-only")
         + ("; torch_math returns zero LSE, so its ring merge is inexact (see 'max err')" if at == "torch_math" else ""))
    runners[f"yunchang LongContextAttention 2x2 ({at}, fwd only)"] = (yunchang_usp(at, *map(shard, (q, k, v))), 2, 2, idx)
    ours = runners["ours usp 2x2"]
    mesh, loc = meshes[(2, 2)], ours[4]
    cu = torch.tensor([0, args.seq], dtype=torch.int32)

    def ours_fwd(mesh=mesh, loc=loc):
        with torch.no_grad():
            return _ours(mesh, *loc, cu)

    runners["ours usp 2x2 (fwd only)"] = (ours_fwd, 2, 2, ours[3])


def _worker(rank, world, init_file, args, results):
    torch.set_num_threads(1)
    if args.watchdog:  # a stuck rank prints where it is, every `watchdog` seconds
        faulthandler.dump_traceback_later(args.watchdog, repeat=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # spawned children: find _peers.py
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    from hf_longctx import init_sequence_parallel

    s, h, hkv, d = args.seq, args.heads, args.kv_heads, args.dim
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, s, n, d, generator=g) for n in (h, hkv, hkv, h))  # global [1, S, H, D]
    cu = torch.tensor([0, s], dtype=torch.int32)

    runners, meshes = {}, {}  # name -> (run() -> output [1, S_local, H, D], U, R, global row indices[, inputs])
    for name, (u, r) in {"ours ulysses 4x1": (4, 1), "ours usp 2x2": (2, 2), "ours ring 1x4": (1, 4)}.items():
        mesh = meshes[(u, r)] = init_sequence_parallel(u, r)  # same order on every rank
        idx = mesh.local_indices(cu)
        local = [t[:, idx].transpose(1, 2).contiguous() for t in (q, k, v)]  # [1, H, S_local, D] as HF gives it
        dlocal = dout[:, idx]

        def run(mesh=mesh, local=local, dlocal=dlocal):
            ins = [t.detach().requires_grad_() for t in local]
            out = _ours(mesh, *ins, cu)
            out.backward(dlocal)
            return out.detach()

        runners[name] = (run, u, r, idx, local)

    if args.peers:
        results.put((rank, "phase", "peer setup"))
        _add_peers(rank, world, q, k, v, dout, args, meshes, runners, lambda m: results.put((rank, "note", m)))

    from _peers import agree, short

    times, sent, calls, err, refs = {name: [] for name in runners}, {}, {}, {}, {}
    for name in list(runners):  # warm-up + counted bytes + error against a single-process reference
        run, idx = runners[name][0], runners[name][3]
        results.put((rank, "phase", f"warm-up of {name}"))
        try:
            with ByteCounter() as c:
                out = run()
            sent[name], calls[name] = c.sent, c.calls
            if args.check:
                key = idx.numpy().tobytes()
                if key not in refs:
                    refs[key] = _reference(q, k, v, idx)
                err[name] = (out - refs[key]).abs().max().item()
            failure = None
        except Exception as e:
            failure = short(e)
            results.put((rank, "note", f"rank {rank}: {name} failed: {failure}"))
        if not agree(failure is None):  # an error on one rank drops the runner on every rank
            results.put((rank, "note", f"{name} dropped: {failure or 'failed on another rank'}"))
            del runners[name], times[name]
    refs.clear()
    for _ in range(args.reps):
        for name, (run, *_) in list(runners.items()):
            results.put((rank, "phase", f"timing {name}"))
            dist.barrier()
            t0 = time.perf_counter()
            try:
                run()
                failure = None
            except Exception as e:
                failure = short(e)
                results.put((rank, "note", f"rank {rank}: {name} failed: {failure}"))
            ok = agree(failure is None)  # doubles as the closing barrier
            times[name].append(time.perf_counter() - t0)
            if not ok:
                results.put((rank, "note", f"{name} dropped mid-run: {failure or 'failed on another rank'}"))
                del runners[name], times[name]
    results.put((rank, "times", {n: (statistics.median(t), sent[n], runners[n][1], runners[n][2], calls[n],
                                     err.get(n, float("nan")), min(t)) for n, t in times.items()}))
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--peers", action="store_true", help="also run DeepSpeed and yunchang (pip install deepspeed yunchang)")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the error check against one process")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds without progress before every rank is stopped (also the gloo timeout)")
    p.add_argument("--watchdog", type=float, default=0, help="dump every rank's stack every N seconds (debug hangs)")
    args = p.parse_args()
    world = 4
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "init")
    procs = [ctx.Process(target=_worker, args=(r, world, init_file, args, results)) for r in range(world)]
    for pr in procs:
        pr.start()
    per_rank, notes, phase, last = {}, set(), {}, time.monotonic()
    while len(per_rank) < world:
        try:
            rank, kind, value = results.get(timeout=10)
        except queue.Empty:
            dead = [r for r, pr in enumerate(procs) if not pr.is_alive() and r not in per_rank]
            stalled = time.monotonic() - last > args.timeout
            if dead or stalled:  # never hang: stop every rank and say where each one was
                for pr in procs:
                    pr.kill()
                for n in sorted(notes):
                    print("note:", n)
                where = "; ".join(f"rank {r}: {phase.get(r, 'setup')}" for r in range(world))
                raise SystemExit(f"ranks {dead} died before reporting (exit codes {[procs[r].exitcode for r in dead]}); {where}"
                                 if dead else f"no progress for {args.timeout:.0f} s, stopped all ranks; {where}")
            continue
        last = time.monotonic()
        if kind == "times":
            per_rank[rank] = value
        elif kind == "phase":
            phase[rank] = value
        else:
            notes.add(value)
    for pr in procs:
        pr.join(timeout=30)  # DeepSpeed may abort at exit: its exit code is not our result

    print(f"\nattention fwd+bwd, 4 gloo ranks x 1 thread, S={args.seq}, H={args.heads}, H_kv={args.kv_heads}, "
          f"D={args.dim}, fp32, causal, median of {args.reps} interleaved runs")
    ms = {name: max(per_rank[r][name][0] for r in per_rank) * 1e3 for name in per_rank[0]}  # slowest rank sets the step
    low = {name: max(per_rank[r][name][6] for r in per_rank) * 1e3 for name in per_rank[0]}  # least-disturbed run
    base = ms.get("ours ulysses 4x1", float("nan"))
    print(f"{'configuration':56s} {'median ms':>9s} {'vs ours 4x1':>11s} {'min ms':>8s} {'MB sent/rank':>13s} "
          f"{'formula MB':>11s} {'colls/rank':>10s} {'max err':>9s}")
    for name, t in ms.items():
        _, sent, u, r, calls, _, _ = per_rank[0][name]
        err = max(per_rank[q][name][5] for q in per_rank)
        fwd_bwd_ours = name.startswith("ours") and "fwd only" not in name
        f = formula_bytes(u, r, args.seq, args.heads, args.kv_heads, args.dim, 4) / 2**20 if fwd_bwd_ours else float("nan")
        print(f"{name:56s} {t:9.1f} {t / base:11.2f} {low[name]:8.1f} {sent / 2**20:13.2f} {f:11.2f} {calls:10d} "
              f"{err:9.1e}")
    ds = "deepspeed UlyssesSPAttentionHF 4x1"
    if ds in ms:
        print(f"ours ulysses 4x1 / {ds} (same shapes, fwd+bwd): {base / ms[ds]:.2f}x by median, "
              f"{low['ours ulysses 4x1'] / low[ds]:.2f}x by min")
    for n in sorted(notes):
        print("note:", n)


if __name__ == "__main__":
    main()
